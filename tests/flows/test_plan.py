"""`dmd2 plan` as a user runs it: the table, the verdict and its exit status, the JSON, and bad input. Server-free:
it runs in the suite's lane (tests/background.py); `dmd2 distill`'s use of the plan is test_plan_refusal.py's."""

import json

import pytest
import torch

from dmd2.config import load_recipe
from dmd2.families.digits.model import build_digits_unet
from dmd2.families.sd3.family import SD3Family
from dmd2.family import family_for
from flows.cli import main
from flows.recipe import DEFAULT_RECIPE
from infra.trainers.memory_plan import plan_memory
from infra.trainers.rehearsal import OUTPUT_STAGES, STAGES
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline

GiB = 2**30


def test_the_default_recipe_fits_and_the_json_holds_every_stage(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu-memory", "1GiB", "--json", str(out), "--gpu-tflops", "100", "--mfu", "0.5"]) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    # digits makes its teacher's reference samples on the host: no "reference" row
    assert list(plan["stages"]) == [*STAGES, "evaluate", "checkpoint"] and plan["fits"] is True
    peak = max(plan["stages"].values(), key=lambda stage: stage["peak"])
    assert plan["stages"][plan["peak_stage"]] == peak
    for name, stage in plan["stages"].items():  # each row's parts add up to its peak
        assert sum(value for key, value in stage.items() if key != "peak") == stage["peak"], name
        assert name in printed
    assert "fits: 1 GPU(s) of 1 GiB" in printed
    # the compute: every stage's FLOPs (test_memory_plan.py checks them), at half of 100 TFLOP/s
    assert plan["flops_per_rollout_per_gpu"] == sum(plan["flops_per_gpu"].values()) > 0
    assert plan["seconds_per_rollout"] == pytest.approx(plan["flops_per_rollout_per_gpu"] / 50e12)
    assert "at 50% MFU of 100 TFLOP/s per GPU" in printed
    # Loading (DDP, one GPU): its rank reads the student's, the critic's and the teacher's digits UNet, each whole
    # in fp32, at most 1.2 times its bytes (the bound tests/dmd2/test_loading.py measures).
    unet = build_digits_unet()
    whole = sum(t.numel() * t.element_size() for t in [*unet.parameters(), *unet.buffers()])
    assert plan["host_loading_per_node"] == int(1.2 * 3 * whole)
    assert f"while the groups load, at most {int(1.2 * 3 * whole) / GiB:.0f} GiB" in printed
    assert plan["host_export"] == whole  # DDP: the student copied from its GPU as safetensors writes it


@pytest.mark.parametrize("overrides, stage, fixes", [
    # The digits evaluation samples its 1000 in one batch: the largest stage of the default recipe.
    ([], "evaluate", ["lower [eval] num_samples", 'parallel = "fsdp"']),
    (["--set", "eval.num_samples=100"], "rollout", ["lower [train] rollout_batch_size", 'parallel = "fsdp"']),
])
def test_a_gpu_too_small_exits_1_naming_the_stage_the_figure_and_the_fix(tmp_path, capsys, overrides, stage, fixes):
    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu-memory", "4MiB", "--json", str(out), *overrides]) == 1
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    peak = plan["stages"][stage]["peak"]
    assert plan["fits"] is False and plan["peak_stage"] == stage
    assert f"does not fit: {stage} needs {peak / GiB:.1f} GiB per GPU" in printed
    assert all(fix in printed for fix in fixes), printed


def exit_status(args: list[str]) -> int:
    try:
        return main(["plan", *args])
    except SystemExit as exit:  # argparse's refusals
        return exit.code


@pytest.mark.parametrize("args, message", [
    (["--gpu-memory", "lots"], "is not a memory size"),
    (["--gpu-memory", "8GiB", "--gpus", "0"], "--gpus must be >= 1"),
    (["--gpu-memory", "8GiB", "--recipe", "no-such.toml"], "--recipe no-such.toml does not exist"),
    (["--gpu-memory", "8GiB", "--set", "train.nope=1"], "nope"),
    (["--gpu-memory", "8GiB", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
    (["--gpu-memory", "8GiB", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
    (["--gpu-memory", "8GiB", "--gpu-tflops", "inf"], "--gpu-tflops a number > 0"),
    (["--gpu-memory", "8GiB", "--gpus", "3", "--set", "train.parallel=hsdp", "--set", "train.shard_group_size=2"],
     "--gpus 3 sets [train] world_size: [train] world_size (3) must be a multiple of shard_group_size (2)"),
    (["--gpu-memory", "8GiB", "--json", "no/such/folder/plan.json"], "--json no/such/folder/plan.json: its folder"),
])
def test_bad_input_is_refused_naming_the_option(args, message, capsys):
    assert exit_status(args) == 2
    assert message in capsys.readouterr().err


def test_an_sd3_pipeline_is_planned_from_its_configs_with_a_bf16_teacher(tmp_path):
    """The SD3 family's path (a pipeline directory's transformer config, a stand-in prompt table): the teacher's
    row is its parameters in bf16, counted independently from the loaded transformer. The evaluation (SD3 splits
    it over the ranks) holds the teacher the same way for its reference samples, and not for the student's; a
    checkpoint holds both groups' state at once (the critic saving beside the awake actor): the actor's as the
    convert stage holds it, and the critic's as it scores."""
    teacher = build_tiny_sd3_pipeline(tmp_path / "teacher")
    config = load_recipe("recipes/sd35-medium-4step.toml").replace("model", teacher=str(teacher)).replace(
        "data", resolution=16).replace("train", world_size=1, rollout_batch_size=10)
    plan = plan_memory(SD3Family().plan_spec(config))
    loaded = SD3Family().load_model(str(teacher), torch.bfloat16)  # as the critic rank loads its teacher
    tensors = [*loaded.parameters(), *loaded.buffers()]
    teacher_bytes = sum(t.numel() * t.element_size() for t in tensors)
    score = next(stage for stage in plan.stages if stage.stage == "score")
    # The plan counts each storage in the CUDA allocator's 512-byte blocks.
    assert teacher_bytes <= score.by_category["teacher"] <= teacher_bytes + 512 * len(tensors)
    assert [stage.stage for stage in plan.stages] == [*STAGES, *OUTPUT_STAGES]
    stages = {stage.stage: stage.by_category for stage in plan.stages}
    assert stages["reference"]["teacher"] == score.by_category["teacher"] and stages["reference"]["temporaries"] > 0
    assert stages["evaluate"]["teacher"] == 0 and stages["evaluate"]["temporaries"] > 0  # the student's: no teacher
    for part in ("weights", "optimizer"):  # the actor's alone (convert) and the critic's alone (score)
        assert stages["checkpoint"][part] == stages["convert"][part] + stages["score"][part] > 0
    assert stages["checkpoint"]["teacher"] == 0  # parked: it comes to the GPU only to score


def test_hsdp_plans_each_gpu_as_fsdp_over_its_shard_group():
    """HSDP over 2 replicas of 2-GPU shard groups holds on each GPU what FSDP2 over 2 GPUs does with the same
    batch per GPU (4 GPUs, twice the global batch), and computes as much."""
    recipe = load_recipe(DEFAULT_RECIPE)
    batch = recipe.train.rollout_batch_size
    fsdp = recipe.replace("train", parallel="fsdp", world_size=2, rollout_batch_size=batch)
    hsdp = recipe.replace("train", parallel="hsdp", world_size=4, shard_group_size=2, rollout_batch_size=2 * batch)
    planned = [plan_memory(family_for(config.model).plan_spec(config)) for config in (fsdp, hsdp)]
    assert [stage.peak for stage in planned[0].stages] == [stage.peak for stage in planned[1].stages]
    assert planned[0].flops == planned[1].flops and planned[0].host_parked == planned[1].host_parked

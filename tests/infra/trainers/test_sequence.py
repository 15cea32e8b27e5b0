"""Sequence parallelism (infra/trainers/sequence.py): a tiny Wan transformer whose tokens two ranks split (two real
processes joined by gloo on CPU, diffusers' Ulysses attention) computes the whole model's output, and the optimizer
step's gradients (the loss scaled as `dmd2.optim.optimizer_step` scales it, then averaged over the ranks as DDP and
FSDP2 average) are the whole model's, alone, with FSDP2 sharding the parameters over the same two ranks, and with
activation checkpointing besides (the recomputed blocks' all-to-alls run again in backward), and with LoRA adapters
(theirs are the only gradients); and so do FLUX.1's and
Qwen-Image's, called through their families' velocities (Qwen-Image's text padded to split, masked)."""

from datetime import timedelta
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist

from dmd2.config import TrainConfig
from infra.trainers.parallel import fsdp
from infra.trainers.sequence import data_rank, sequence_mesh, sequence_rank, split_sequence
from tests.dmd2.families.flux.tiny_pipeline import CLIP_WIDTH, tiny_flux_transformer
from tests.dmd2.families.flux.tiny_pipeline import TEXT_WIDTH as FLUX_TEXT
from tests.dmd2.families.qwen_image.tiny_pipeline import TEXT_WIDTH as QWEN_TEXT
from tests.dmd2.families.qwen_image.tiny_pipeline import tiny_qwen_image_transformer
from tests.dmd2.families.wan.tiny_pipeline import TEXT_DIM, tiny_wan_transformer

# name -> ([train] parallel, activation checkpointing: each block's forward, all-to-alls included, run again in
# backward, LoRA adapters on the attention layers: only they train)
LAYOUTS = {"ddp": ("ddp", False, False), "fsdp": ("fsdp", False, False), "fsdp-checkpointed": ("fsdp", True, False),
           "fsdp-lora": ("fsdp", False, True)}
LATENTS = (2, 4, 3, 4, 6)  # batch, channels, latent frames, height, width: 3 x 2 x 3 = 18 tokens per sample


def wan_model(lora: bool) -> torch.nn.Module:
    """The tiny Wan transformer, with rank-4 LoRA adapters on its attention layers (the family's targets) if ``lora``."""
    from dmd2.lora import add_adapters

    model = tiny_wan_transformer()
    return add_adapters(model, 4, 4.0, ("to_q", "to_k", "to_v", "to_out.0"), seed=0) if lora else model


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(LATENTS, generator=generator),
            "timestep": torch.tensor([250.0, 800.0]),
            "encoder_hidden_states": torch.randn(2, 5, TEXT_DIM, generator=generator)}


def loss_and_output(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    batch = inputs()
    target = torch.randn(LATENTS, generator=torch.Generator().manual_seed(2))
    output = model(**batch, return_dict=False)[0]
    return torch.nn.functional.mse_loss(output, target), output.detach()


def whole_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole (an FSDP2 shard's gathered); none for a parameter the call did not use."""
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in model.named_parameters() if p.grad is not None}


# FLUX.1 and Qwen-Image called through the families' velocities (packing, ids, the text and its mask) on latents
# [2, 4, 8, 8]: 16 image tokens; FLUX's 4 text tokens, Qwen's 5 (padded to 6 for the two ranks, masked).
PACKED_FAMILIES = {"flux": tiny_flux_transformer, "qwen_image": tiny_qwen_image_transformer}


def packed_loss_and_output(name: str, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    from dmd2.families.flux.velocity import FluxVelocity
    from dmd2.families.qwen_image.prompts import QwenPromptTable
    from dmd2.families.qwen_image.velocity import QwenImageVelocity
    from dmd2.flow_pipeline.prompts import PromptTable

    generator = torch.Generator().manual_seed(3)
    if name == "flux":
        table = PromptTable(*(torch.randn(shape, generator=generator) for shape in
                              ((2, 4, FLUX_TEXT), (2, CLIP_WIDTH), (1, 4, FLUX_TEXT), (1, CLIP_WIDTH))))
        velocity = FluxVelocity(model, table, guidance=3.5)
    else:
        table = QwenPromptTable(torch.randn(2, 5, QWEN_TEXT, generator=generator),
                                torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
                                torch.randn(1, 5, QWEN_TEXT, generator=generator), torch.tensor([[1, 1, 0, 0, 0]]))
        velocity = QwenImageVelocity(model, table)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    output = velocity(latents, torch.tensor([0.25, 0.8]), {"prompt_index": torch.tensor([0, 1])})
    target = torch.randn(latents.shape, generator=generator)
    return torch.nn.functional.mse_loss(output, target), output.detach()


def _rank(rank: int, root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        for name, (parallel, checkpointed, lora) in LAYOUTS.items():
            train = TrainConfig(world_size=2, sequence_parallel=2, parallel=parallel, rollout_batch_size=2)
            model = split_sequence(wan_model(lora), sequence_mesh(train, "cpu"))
            if checkpointed:
                model.enable_gradient_checkpointing()
            tokens = []
            model.blocks[0].register_forward_hook(lambda module, args, out: tokens.append(out.shape[1]))
            if parallel == "fsdp":
                model = fsdp(model, bf16=False)
            loss, output = loss_and_output(model)
            (loss * train.sequence_parallel).backward()  # as `optimizer_step` differentiates it
            gradients = whole_gradients(model)
            if parallel == "ddp":  # DDP's average over the ranks (FSDP2's reduce-scatter averaged already)
                for gradient in gradients.values():
                    dist.all_reduce(gradient)
                    gradient /= 2
            torch.save({"loss": loss.detach(), "output": output, "gradients": gradients, "tokens": tokens,
                        "ranks": (data_rank(rank, train), sequence_rank(rank, train))},
                       root / f"{name}-{rank}.pt")
        for name, build in PACKED_FAMILIES.items():  # plain: the layouts compose with any model, as Wan's show
            train = TrainConfig(world_size=2, sequence_parallel=2, rollout_batch_size=2)
            model = split_sequence(build(), sequence_mesh(train, "cpu"))
            tokens = []  # the first block's outputs' lengths: its text's and its image's tokens on this rank
            model.transformer_blocks[0].register_forward_hook(
                lambda module, args, out: tokens.append(sorted(t.shape[1] for t in out)))
            loss, output = packed_loss_and_output(name, model)
            (loss * train.sequence_parallel).backward()
            gradients = whole_gradients(model)
            for gradient in gradients.values():  # DDP's average over the ranks
                dist.all_reduce(gradient)
                gradient /= 2
            torch.save({"loss": loss.detach(), "output": output, "gradients": gradients, "tokens": tokens},
                       root / f"{name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks, each importing diffusers: ~35 s
def test_two_ranks_splitting_the_tokens_give_the_whole_models_output_and_gradients(tmp_path):
    torch.multiprocessing.start_processes(_rank, args=(tmp_path,), nprocs=2, start_method="spawn")
    for name, (_, _, lora) in LAYOUTS.items():
        model = wan_model(lora)
        loss, output = loss_and_output(model)
        loss.backward()
        expected = whole_gradients(model)
        assert expected and all(("lora_" in key) == lora for key in expected), name
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            assert got["ranks"] == (0, rank)
            assert got["tokens"] == [18 // 2]  # each rank's blocks saw half of every sample's tokens
            assert torch.allclose(got["loss"], loss.detach(), atol=1e-6)
            assert (got["output"] - output).abs().max() <= 1e-5
            assert got["gradients"].keys() == expected.keys()
            for key, gradient in expected.items():
                assert (got["gradients"][key] - gradient).abs().max() <= 1e-5, (name, key)
    for name, build in PACKED_FAMILIES.items():
        model = build()
        loss, output = packed_loss_and_output(name, model)
        loss.backward()
        expected = whole_gradients(model)
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            assert got["tokens"] == [[2, 8] if name == "flux" else [3, 8]]  # 4 (or 5 padded to 6) text, 16 image
            assert torch.allclose(got["loss"], loss.detach(), atol=1e-6), name
            assert (got["output"] - output).abs().max() <= 1e-5, name
            assert got["gradients"].keys() == expected.keys()
            for key, gradient in expected.items():
                assert (got["gradients"][key] - gradient).abs().max() <= 1e-5, (name, key)


# -- two rollouts of the Wan family's groups (Ray ranks, gloo), a checkpoint saved and loaded between them: sequence
# parallelism changes nothing

PROMPTS = ["a cat runs on the grass", "a red ball", "the dog jumps", "a blue ball on the grass"]
RUN, ROLLOUTS = "sp", 2


def wan_spec(teacher: Path, prompts: Path, store, world_size: int, **train):
    """DMD2 on the tiny Wan teacher: 5 frames of 32 x 32 px (2 latent frames of 2 x 2 patches: 8 tokens per sample),
    4 samples per rollout over the data ranks, K = 2, a 2-step student, its prompts prepared into ``store``."""
    from dataclasses import replace

    from dmd2.config import config_from_dict
    from dmd2.family import family_for
    from infra.trainers.prepare import prepare_inputs

    config = config_from_dict({
        "model": {"family": "wan", "teacher": str(teacher)}, "student": {"num_steps": 2},
        "optim": {"lr": 1e-3, "critic_lr": 2e-3},
        "dmd2": {"critic_steps_per_rollout": 2, "teacher_guidance_scale": 2.0},
        "train": {"rollout_batch_size": 4, "world_size": world_size, "rollouts": ROLLOUTS, **train},
        "data": {"prompts": str(prompts), "frames": 5, "height": 32, "width": 32, "max_sequence_length": 8},
        "eval": {"prompts": PROMPTS[:3], "reference_steps": 2}})
    family = family_for(config.model)
    family.check(config)
    config = family.resolve(config, teacher.parent / "cache")
    spec = family.run_spec(config, teacher.parent / "cache")
    return replace(spec, prepared=prepare_inputs(family, config, store)[0])


def two_rollouts(spec, store) -> dict:
    """Each rollout's metrics (a checkpoint saved between them and loaded back in place), the groups' weights after
    two, read back from rank 0's export, the student's evaluation (split over the ranks: 3 prompts x 2 noises), and
    whether each rank's evaluation borrowed the critic's teacher for its reference samples."""
    from infra.trainers.cluster import RankResources
    from infra.trainers.stages import build_groups, load_groups, run_rollout_on_groups, save_groups

    run = f"{RUN}-{spec.config.train.world_size}-{spec.config.train.parallel}"
    groups = build_groups(spec, store, RankResources(num_cpus=0.5))
    try:
        metrics = [run_rollout_on_groups(groups, run, 0)]
        load_groups(groups, save_groups(groups, run, step=1))
        metrics.append(run_rollout_on_groups(groups, run, 1))
        weights = {group.role: store.get_tensors(group.export_weights(f"{run}/{group.role}.safetensors")[0])
                   for group in groups.in_order()}
        scores = groups.actor.evaluate(run, ROLLOUTS).scores
        borrowed = ray.get([process.__ray_call__.remote(lambda process: process.workers["actor"]._evaluator.lent_teacher
                                                        is not None) for process in groups.actor.processes])
        return {"metrics": metrics, "weights": weights, "scores": scores, "borrowed": borrowed}
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def wan_runs(shared_ray, tmp_path_factory):
    from tests.dmd2.families.wan.tiny_pipeline import build_tiny_wan_pipeline
    from tests.infra.trainers.ray_fixtures import new_store

    tmp = tmp_path_factory.mktemp("sequence")
    teacher = build_tiny_wan_pipeline(tmp / "teacher")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    store = new_store(tmp)
    return {name: two_rollouts(wan_spec(teacher, prompts, store, world_size, **train), store)
            for name, world_size, train in (("alone", 1, {}), ("ddp", 2, {"sequence_parallel": 2}),
                                            ("fsdp", 2, {"sequence_parallel": 2, "parallel": "fsdp"}))}


@pytest.mark.slow  # three runs of Ray groups, each evaluated: ~70 s
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_rollouts_with_the_tokens_split_over_two_ranks_train_the_same_models_as_one_rank(wan_runs, parallel):
    from tests.infra.trainers.ray_fixtures import max_abs_diff

    alone, split = wan_runs["alone"], wan_runs[parallel]
    for role in ("actor", "critic"):
        assert max_abs_diff(alone["weights"][role], split["weights"][role]) <= 1e-5, role
    for one, two in zip(alone["metrics"], split["metrics"]):
        for key in ("loss", "critic-loss", "grad_norm", "critic-grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4), key
    # Each sequence group sampled one share of the evaluation, the teacher's references with the critic's teacher
    # split over it as for scoring: the same videos, scored alike.
    assert split["borrowed"] == [True, True]
    assert alone["scores"] and split["scores"].keys() == alone["scores"].keys()
    for key, value in alone["scores"].items():
        assert split["scores"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


def test_dmd2_plan_gives_each_gpu_its_share_of_the_tokens_activations_and_compute(tmp_path):
    """The plan rehearses the split model on a fake process group: with a sample's 3 x 8 x 8 = 192 tokens split over
    two GPUs, what a GPU keeps for backward and the rollout's and scoring's FLOPs are about half of one GPU's with
    the whole sample (attention's backward recomputes its forward in diffusers' Ulysses: the training FLOPs are
    more than half)."""
    from dmd2.config import config_from_dict
    from dmd2.family import family_for
    from infra.trainers.memory_plan import plan_memory
    from tests.dmd2.families.wan.tiny_pipeline import build_tiny_wan_pipeline

    teacher = build_tiny_wan_pipeline(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")

    def plan(sequence_parallel: int):  # one sample per critic step on each GPU, or on each pair of GPUs
        config = config_from_dict({
            "model": {"family": "wan", "teacher": str(teacher)}, "dmd2": {"critic_steps_per_rollout": 1},
            "train": {"world_size": 2, "sequence_parallel": sequence_parallel, "parallel": "fsdp",
                      "rollout_batch_size": 2 // sequence_parallel},
            "data": {"prompts": str(prompts), "frames": 9, "height": 128, "width": 128, "max_sequence_length": 8}})
        plan = plan_memory(family_for(config.model).plan_spec(config))
        return {stage.stage: stage.by_category["activations"] for stage in plan.stages}, plan.flops

    (whole, whole_flops), (split, split_flops) = plan(1), plan(2)
    for stage in ("critic-train", "actor-train"):
        assert 0.4 * whole[stage] < split[stage] < 0.55 * whole[stage], stage
        assert 0.5 * whole_flops[stage] < split_flops[stage] < 0.7 * whole_flops[stage], stage
    for stage in ("rollout", "score"):
        assert 0.45 * whole_flops[stage] < split_flops[stage] < 0.55 * whole_flops[stage], stage

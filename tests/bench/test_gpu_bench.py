"""bench/gpu.py and gpu_table.py: the CPU table on the tests' tiny pipeline (every row, finite positive
figures), the rollout's FLOP count against the calls `rollout_shard` makes, the device peak's sum, and
on CUDA what sleeping saves."""

import contextlib
import io
import json
import math

import pytest
import torch

from bench import gpu
from bench.gpu_table import ROWS
from dmd2.conditioning import ClassLabels
from dmd2.config import config_from_dict
from dmd2.plan import rollout_plan
from dmd2.rollout import rollout_shard

MiB = 2**20
TIMES = ("seconds_per_rollout", "seconds_per_critic_step", "seconds_per_actor_step", "seconds_rollout_stage",
         "seconds_score", "samples_per_second", "tflops_per_device")


@pytest.fixture(scope="module")
def tiny_table(shared_ray, tmp_path_factory):  # the session's Ray: bench.gpu joins it rather than start its own
    path = tmp_path_factory.mktemp("bench") / "gpu.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = gpu.main(["--tiny", "--rollouts", "1", "--json", str(path)])
    return {"printed": printed.getvalue(), "result": result, "json": json.loads(path.read_text())}


def test_the_tiny_table_prints_the_command_and_every_row(tiny_table):
    lines = tiny_table["printed"].splitlines()
    assert lines[0].startswith("command: python -m bench.gpu --tiny --rollouts 1 --json ")
    for label, _, _ in ROWS:
        assert any(line.startswith(f"| {label} | ") for line in lines), label
    assert "memory rows n/a" in tiny_table["printed"]  # CPU ranks have no accelerator memory to report


def test_the_tiny_figures_are_positive_and_finite(tiny_table):
    result = tiny_table["result"]
    assert tiny_table["json"] == json.loads(json.dumps(result))  # --json holds what was printed
    flops = result["flops"]
    assert flops["forward"] > 0 and 2.5 < flops["forward_backward"] / flops["forward"] < 3.5
    run = result["runs"]["ddp"]
    for mode in ("sleep", "no_sleep"):
        for key in TIMES:
            assert math.isfinite(run[mode][key]) and run[mode][key] > 0, (mode, key, run[mode][key])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in tiny_table["printed"].splitlines()
             if line.startswith(("| s / ", "| samples / s"))]
    assert len(cells) == 9 and all(math.isfinite(float(value)) and float(value) > 0 for _, value in cells), cells


def test_the_rollout_flops_count_the_student_calls_rollout_shard_makes():
    config = config_from_dict({"model": {"teacher": "builtin:digits"}, "student": {"num_steps": 4},
                               "dmd2": {"critic_steps_per_rollout": 3},
                               "train": {"rollout_batch_size": 12, "world_size": 2}})
    rows_per_call = []

    def student(x_s, sigma, cond):
        rows_per_call.append(x_s.shape[0])
        return torch.zeros_like(x_s)

    for rollout_id in range(3):
        rows_per_call.clear()
        plan = rollout_plan(config, rollout_id, (1, 2, 2))
        for rank in range(2):
            rollout_shard(student, ClassLabels(10, 10), plan, rank)
        counted = gpu.rollout_flops(config, (1, 2, 2), rollout_id, forward=1.0, forward_backward=3.0)
        assert counted["rollout"] == sum(rows_per_call)  # one forward per sample per call
        assert counted["critic-train"] == 3 * 2 * 2 * 3.0 and counted["actor-train"] == 2 * 2 * 3.0
        assert counted["score"] == 2 * 2 * 2 * 1.0  # CFG: both branches for each scored sample


def test_the_device_peak_adds_what_the_idle_group_holds_step_by_step():
    """Two rollouts of three steps on 2 ranks: the peak is per rank and per step, the sum of both groups."""
    config = config_from_dict({"model": {"teacher": "builtin:digits"}, "dmd2": {"critic_steps_per_rollout": 2},
                               "train": {"rollout_batch_size": 8, "world_size": 2}})

    def rollout(seconds):
        return [gpu.Step("rollout", seconds, {"actor": [10, 11], "critic": [1, 1]}, None),
                gpu.Step("critic-train", 2 * seconds, {"actor": [8, 8], "critic": [20, 23]}, None),
                gpu.Step("actor-train", seconds, {"actor": [29, 12], "critic": [1, 1]}, None)]

    figures = gpu.summarize([rollout(1.0), rollout(2.0)], [8e12, 16e12], config, peak=4e12)
    assert figures["device_peak"] == 31 and figures["device_peak_at"] == "critic-train"  # rank 1: 8 + 23
    assert figures["group_peak"] == {"actor": [29, 12], "critic": [20, 23]}
    assert figures["seconds_per_rollout"] == 6.0 and figures["seconds_per_critic_step"] == 3.0 / 2
    assert figures["samples_per_second"] == 8 / 6.0
    assert figures["mfu"] == pytest.approx(24e12 / 2 / 12.0 / 4e12)  # FLOPs per device over the seconds, over peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_sleep_the_device_peak_is_the_largest_group_not_the_sum():
    """A mid-size MMDiT (bench/gpu.py's "small" shape), DDP at world size 1, both groups on one GPU."""
    result = gpu.main(["--shape", "small", "--rollouts", "1"])
    sleep = result["runs"]["ddp"]["sleep"]
    peaks = {role: max(per_rank) for role, per_rank in sleep["group_peak"].items()}
    slack = 0.1 * max(peaks.values()) + 256 * MiB
    assert sleep["device_peak"] <= max(peaks.values()) + slack, (sleep["device_peak"], peaks, sleep["device_peak_at"])
    assert sleep["device_peak"] < sum(peaks.values()), (sleep["device_peak"], peaks)

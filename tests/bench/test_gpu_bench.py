"""bench/gpu.py, the single-process device check, run here as on the GPU image: with Ray, Prefect, MLflow, boto3
and moto absent (tests/bench/absent_packages.py), at the tiny shape on CPU; the GPU tests collected the same
way; the table's arithmetic against a hand count; and on CUDA, each stage's measured peak against `dmd2 plan`."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_table import STAGES, stage_rows
from infra.trainers.parallel import no_buffer_sync

REPO = Path(__file__).resolve().parents[2]
WITHOUT_SERVERS = [sys.executable, str(REPO / "tests" / "bench" / "absent_packages.py")]
ROWS = (*STAGES, "between stages", "whole rollout")
GPU_TEST_FILES = ["tests/bench/test_gpu_bench.py", "tests/dmd2/test_on_device.py", "tests/dmd2/test_step_syncs.py",
                  "tests/dmd2/test_compile.py"]
# The device path's torch calls newer than the GPU image's torch 2.11 (seen failing there), each with the one
# place allowed to use it: a guard that falls back on 2.11's spelling.
NEWER_THAN_TORCH_2_11 = {"forward_sync_buffers": "infra/trainers/parallel.py"}


def run_without_servers(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*WITHOUT_SERVERS, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def printed_rows(printed: str) -> dict[str, dict[str, list[str]]]:
    """Each variant's table rows as printed: {variant: {row name: its cells}}."""
    rows, variant = {}, None
    for line in printed.splitlines():
        if line.startswith("variant "):
            variant = line.split()[1].rstrip(":")
            rows[variant] = {}
        elif line.startswith("| ") and not line.startswith("| stage |") and variant:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[variant][cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def device_call(tmp_path_factory) -> dict:
    """bench/gpu_check.sh, the whole device call, at the tiny shape on CPU: its results folder."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--variants", "sleep", "no-sleep", "--rollouts", "1",
                           "--peak-tflops", "1"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OUT": str(out), "PY": sys.executable, "WORKDIR": str(out / "work")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {name: (out / name).read_text() for name in ("summary.txt", "gpu.txt", "gpu.json", "pytest.txt")}


@pytest.fixture(scope="module")
def tiny_check(device_call) -> tuple[str, dict]:
    return device_call["gpu.txt"], json.loads(device_call["gpu.json"])


def test_the_absent_packages_really_are_absent():
    done = run_without_servers("-m", "infra.trainers.cluster", timeout=60)  # its first import is Ray
    assert done.returncode != 0 and "ModuleNotFoundError: import of ray halted" in done.stderr, done.stderr


def test_the_check_prints_every_row_of_every_variant_without_the_servers_packages(tiny_check):
    printed, result = tiny_check
    assert printed.startswith("command: python bench/gpu.py --workdir ") and " --variants sleep no-sleep " in printed
    assert "stated 1 TFLOP/s" in printed
    rows = printed_rows(printed)
    assert sorted(rows) == ["no-sleep", "sleep"]
    for variant, table in rows.items():
        assert "error" not in result["variants"][variant]
        assert list(table) == list(ROWS), variant
        for stage in ("rollout", "critic-train", "score", "actor-train"):
            compute, wall, tflop, mfu_stated, mfu_matmul = table[stage][:5]
            figures = [float(compute), float(wall), float(tflop), float(mfu_stated.rstrip("%"))]
            assert all(math.isfinite(value) and value > 0 for value in figures), (variant, stage, table[stage])
            assert mfu_matmul.endswith("%")
            assert table[stage][5] == "n/a"  # CPU: no device memory to measure
        assert float(table["between stages"][1]) >= 0
    assert all(float(rows["sleep"][stage][6]) > 0 for stage in STAGES)  # the plan's prediction, per stage


def test_the_json_holds_each_stage_as_measured_and_the_plan(tiny_check):
    printed, result = tiny_check
    rows = printed_rows(printed)
    for variant in ("sleep", "no-sleep"):
        figures = result["variants"][variant]
        measured, flops = figures["rollouts"]["0"], figures["plan"]["flops"]
        for stage in ("critic-train", "actor-train"):
            mfu = flops[stage] / measured[stage]["compute_s"] / 1e12  # --peak-tflops 1
            assert rows[variant][stage][3] == f"{mfu * 100:.3g}%", (variant, stage)
            assert measured[stage]["wall_s"] >= measured[stage]["compute_s"] > 0  # CPU: compute is the host clock
        assert measured["rollout_wall_s"] >= sum(measured[stage]["wall_s"] for stage in STAGES)


def test_the_device_call_runs_the_check_and_the_gpu_tests_without_the_servers_packages(device_call):
    summary = device_call["summary.txt"]
    assert "bench/gpu.py: exit 0" in summary and "gpu tests: exit 0" in summary, summary
    for path in GPU_TEST_FILES:  # collected (so imported) with the packages absent; skipped without CUDA
        assert "SKIPPED" in device_call["pytest.txt"] and path in device_call["pytest.txt"], device_call["pytest.txt"]


def test_the_device_path_guards_what_torch_2_11_lacks():
    sources = [*REPO.glob("dmd2/**/*.py"), *REPO.glob("infra/trainers/*.py"), REPO / "bench" / "gpu.py"]
    for name, guard in NEWER_THAN_TORCH_2_11.items():
        users = [path.relative_to(REPO).as_posix() for path in sources if name in path.read_text()]
        assert users == [guard], (name, users)

    class DdpOfTorch211(torch.nn.Module):  # the signature's part that matters: no forward_sync_buffers
        def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True):
            super().__init__()

    assert no_buffer_sync(DdpOfTorch211) == {"broadcast_buffers": False}
    assert no_buffer_sync(torch.nn.parallel.DistributedDataParallel) == (
        {"forward_sync_buffers": False} if torch.__version__ >= "2.13" else {"broadcast_buffers": False})


def test_the_table_counts_mfu_over_compute_and_the_rollout_over_its_wall_time():
    result = {"peak_flops_stated": 8e12, "matmul_flops": 4e12}
    rollout = {stage: {"compute_s": 0.5, "wall_s": 0.6, "peak_bytes": 100} for stage in STAGES}
    variant = {"plan": {"flops": {stage: 2e12 for stage in STAGES}, "resident": 300,
                        "stages": [{"stage": stage, "peak": 200, "by_category": {}} for stage in STAGES]},
               "rollouts": {"0": rollout | {"rollout_wall_s": 4.0}, "1": rollout | {"rollout_wall_s": 5.0}}}
    rows = {row["stage"]: row for row in stage_rows(result, variant, sleeps=True)}
    assert rows["score"]["mfu_stated"] == pytest.approx(2e12 / 0.5 / 8e12)
    assert rows["score"]["mfu_matmul"] == pytest.approx(2e12 / 0.5 / 4e12)
    assert rows["between stages"]["wall"] == pytest.approx(4.5 - 5 * 0.6)
    assert rows["whole rollout"]["mfu_stated"] == pytest.approx(5 * 2e12 / 4.5 / 8e12)
    assert rows["whole rollout"]["peak"] == 100 and rows["whole rollout"]["plan"] == 200
    resident = {row["stage"]: row for row in stage_rows(result, variant, sleeps=False)}
    assert resident["score"]["plan"] is None and resident["whole rollout"]["plan"] == 300  # nothing asleep: resident


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_on_cuda_each_stages_peak_is_within_the_plan_plus_10_percent(parallel, tmp_path):
    """The tiny pipeline, bf16, world size 1 (an FSDP2 step on CUDA with `fsdp`): every stage's
    torch.cuda.max_memory_allocated against `dmd2 plan`'s prediction for the same run."""
    from bench import gpu

    result = gpu.main(["--tiny", "--variants", "sleep", "--rollouts", "1", "--parallel", parallel,
                       "--workdir", str(tmp_path)])
    variant = result["variants"]["sleep"]
    assert "error" not in variant, variant.get("error")
    planned = {stage["stage"]: stage["peak"] for stage in variant["plan"]["stages"]}
    for stage, figures in variant["rollouts"]["0"].items():
        if stage in planned:
            assert figures["peak_bytes"] <= 1.1 * planned[stage], (stage, figures["peak_bytes"], planned[stage])

"""A new user's day one: the CLI in a fresh working directory, with the default store and outputs.

The first run trains; a second started on the same run id while the first holds it is refused in seconds,
naming the first, and logs nothing (one run per run id: the lease in the store, infra/store/lease.py); a
third, after the first, reports the first's result and trains nothing; a fourth that would cut the run back
to fewer rollouts is refused before Prefect starts. The MLflow run stays FINISHED, records
the two runs that ran, and holds every step once; no process the CLIs started (Prefect's local server, Ray)
outlives them. Nothing is mocked: each CLI starts its own local Prefect server, a local Ray and MLflow on
sqlite, as `dmd2 distill` does on a user's machine.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from infra.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.rollouts=2", "train.rollout_batch_size=8", "dmd2.critic_steps_per_rollout=2",
         "train.save_interval=1", "eval.num_samples=50", "eval.reference_steps=4"]
RUN_ID = "digits-4step"  # the default recipe's


def start_cli(workdir: Path, teacher: Path, cache: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DMD2_", "RAY_"))}
    env |= {"PREFECT_HOME": str(workdir / ".prefect"), "DMD2_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    overrides = [arg for item in [f"model.teacher={teacher}", *SMALL] for arg in ("--set", item)]
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "distill", *overrides, *args], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_cli_in_a_fresh_directory_trains_once_refuses_a_second_run_and_reports_the_first(tiny_teacher_dir,
                                                                                              shared_cache, tmp_path):
    workdir, cache = tmp_path / "fresh", shared_cache  # the user's cache (~/.cache/dmd2) outlives a directory
    workdir.mkdir()
    store = ArtifactStore((workdir / "artifacts").as_uri())  # the default store, apart from the outputs
    first = start_cli(workdir, tiny_teacher_dir, cache)
    deadline = time.monotonic() + 300
    while store.find_json(f"{RUN_ID}/lease.json") is None:  # the first run holds the run id
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    second = start_cli(workdir, tiny_teacher_dir, cache)
    out, err = second.communicate(timeout=120)
    assert first.poll() is None, "the first run ended before the second was refused: nothing was shown"
    assert second.returncode != 0 and f"pid {first.pid}" in err and "Traceback" not in err, out + err
    first_out, first_err = first.communicate(timeout=900)
    assert first.returncode == 0, first_out + first_err
    student = workdir / "outputs" / RUN_ID / "student"
    weights = (student / "diffusion_pytorch_model.safetensors").read_bytes()

    third = start_cli(workdir, tiny_teacher_dir, cache)
    third_out, third_err = third.communicate(timeout=900)
    assert third.returncode == 0, third_out + third_err
    assert "already finished its 2 rollouts: nothing to train" in third_out
    for out, err in [(first_out, first_err), (third_out, third_err)]:
        assert "Traceback" not in err and "Failed to send telemetry" not in err
        assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in out
    assert (student / "diffusion_pytorch_model.safetensors").read_bytes() == weights
    fewer = start_cli(workdir, tiny_teacher_dir, cache, "--rollouts", "1")
    out, err = fewer.communicate(timeout=120)
    assert fewer.returncode == 2 and err.startswith("error: run digits-4step already has 2 rollouts; pass rollouts "
                                                    ">= 2") and "Traceback" not in err, out + err

    assert store.list_checkpoints(RUN_ID) == [1, 2]
    assert store.find_json(f"{RUN_ID}/lease.json") is None  # released at the end
    assert (workdir / "outputs" / RUN_ID / "samples.png").is_file()
    assert started_in(workdir, within_s=30) == [], "processes the CLIs started outlived them"
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
    assert run.info.status == "FINISHED"
    assert len([key for key in run.data.tags if key.startswith("prefect.flow_run.")]) == 2  # not the refused one
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1]


def started_in(workdir: Path, within_s: float) -> list[str]:
    """The processes still running, after up to ``within_s`` seconds, that a CLI of ``workdir`` started (they
    inherited its PREFECT_HOME): its Prefect server, the watcher beside it, Ray's."""
    home, deadline = str(workdir / ".prefect"), time.monotonic() + within_s
    while True:
        left = []
        for process in psutil.process_iter(["cmdline"]):
            try:
                if process.environ().get("PREFECT_HOME") == home:
                    left.append(" ".join(process.info["cmdline"] or [])[:200])
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)

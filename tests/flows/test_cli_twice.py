"""A new user's day one: the CLI twice in a fresh working directory, with the default store and outputs.

Both runs exit 0; the second reports the first's result and trains nothing; the MLflow run stays
FINISHED and records both Prefect flow runs. Nothing is mocked: the CLI starts its own local Prefect
server, a local Ray and MLflow on sqlite, as `dmd2 distill` does on a user's machine.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from infra.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.rollouts=2", "train.rollout_batch_size=8", "dmd2.critic_steps_per_rollout=2",
         "train.save_interval=1", "eval.num_samples=50", "eval.reference_steps=4"]


def _cli(workdir: Path, teacher: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DMD2_", "RAY_"))}
    env |= {"PREFECT_HOME": str(workdir / ".prefect"), "DMD2_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    overrides = [arg for item in [f"model.teacher={teacher}", *SMALL] for arg in ("--set", item)]
    return subprocess.run([sys.executable, "-m", "flows.cli", "distill", *overrides], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_cli_twice_in_a_fresh_directory(tiny_teacher_dir, tmp_path, fresh_ray):
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    first = _cli(workdir, tiny_teacher_dir, tmp_path / "cache")
    assert first.returncode == 0, first.stdout + first.stderr
    student = workdir / "outputs" / "digits-4step" / "student"
    weights = (student / "diffusion_pytorch_model.safetensors").read_bytes()

    second = _cli(workdir, tiny_teacher_dir, tmp_path / "cache")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already finished its 2 rollouts: nothing to train" in second.stdout
    for run in (first, second):
        assert "Traceback" not in run.stderr and "Failed to send telemetry" not in run.stderr
        assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in run.stdout
    assert (student / "diffusion_pytorch_model.safetensors").read_bytes() == weights

    store = ArtifactStore((workdir / "artifacts").as_uri())  # the default store, apart from the outputs
    assert store.list_checkpoints("digits-4step") == [1, 2]
    assert (workdir / "outputs" / "digits-4step" / "samples.png").is_file()
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
    assert run.info.status == "FINISHED"
    flow_runs = [key for key in run.data.tags if key.startswith("prefect.flow_run.")]
    assert len(flow_runs) == 2
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1]

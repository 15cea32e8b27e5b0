"""One run per run id: two `dmd2 distill --run-id X` at once train once; the second is refused in
seconds, naming the first, and no metric step is logged twice. A lease on the run id in the store
(infra/store/lease.py) decides, also for runs started inside Prefect."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.distill import distill
from infra.store import ArtifactStore, LeaseHeldError, RunLease
from tests.flows.conftest import write_recipe

REPO = Path(__file__).resolve().parents[2]


def start_cli(workdir: Path, recipe: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DMD2_", "RAY_"))}
    env |= {"PREFECT_HOME": str(workdir / ".prefect"), "DMD2_CACHE": str(workdir / "cache"), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "distill", "--recipe", str(recipe), "--run-id", "once",
                             *extra], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_cli_run_on_a_held_run_id_is_refused_at_once_and_nothing_is_logged_twice(tiny_teacher_dir,
                                                                                          tmp_path, fresh_ray):
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=6)
    store = ArtifactStore((tmp_path / "artifacts").as_uri())
    first = start_cli(tmp_path, recipe)
    deadline = time.monotonic() + 300
    while store.find_json("once/lease.json") is None:  # the first run holds the run id
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.5)
    started = time.monotonic()
    second = start_cli(tmp_path, recipe)
    out, err = second.communicate(timeout=120)
    refused_after = time.monotonic() - started
    assert second.returncode != 0 and f"pid {first.pid}" in err, out + err
    assert "Traceback" not in err
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, out + err
    print(f"refused after {refused_after:.1f} s")

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(6))
    assert store.find_json("once/lease.json") is None  # released at the end


def test_the_flow_refuses_a_held_run_id_before_it_starts_an_mlflow_run(prefect_server, tiny_teacher_dir, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=2)
    store_uri = (tmp_path / "store").as_uri()
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with RunLease.acquire(ArtifactStore(store_uri), "busy", "another flow run on host-b"):
        with pytest.raises(LeaseHeldError, match="another flow run on host-b"):
            distill(recipe=str(recipe), run_id="busy", store_uri=store_uri, tracking_uri=tracking,
                    output_dir=str(tmp_path / "outputs"), cache_dir=str(tmp_path / "cache"))
    client = MlflowClient(tracking)
    experiment = client.get_experiment_by_name("dmd2")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []

"""Resume: a distill run killed mid-way (SIGKILL) and rerun with the same run id ends with the same
weights as an uninterrupted run, in the same MLflow run, with no metric step logged twice."""

import os
import signal
import subprocess
import sys
import time

import ray
import torch
from mlflow import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.distill import distill
from dmd2.model import load_pretrained as load_model
from infra.store import ArtifactStore
from tests.flows.conftest import TINY_EVAL_INTERVAL, TINY_ROLLOUTS, write_recipe
from tests.tracking_db import tracking_uri_in

ROLLOUTS = TINY_ROLLOUTS  # the shared uninterrupted run's recipe


def _kill_after_checkpoint(command, env, log, store: ArtifactStore, run_id: str, step: int, timeout: float = 300):
    """Start the CLI, wait for checkpoint `step`, SIGKILL it mid-run (its rank processes die with it: Ray ends
    the actors of a driver that is gone)."""
    # output goes to a file: a pipe nobody reads would fill up and stall the run
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            latest = store.latest_checkpoint(run_id)
            if latest is not None and latest.step >= step:
                return latest.step
            if process.poll() is not None:
                raise AssertionError(f"the run ended before it could be killed: {log.name}")
            time.sleep(0.2)
        raise AssertionError("no checkpoint appeared in time")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_killed_run_resumes_to_the_uninterrupted_result(prefect_server, s3_store, tiny_run, tiny_teacher_dir,
                                                          shared_ray, shared_cache, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, ROLLOUTS, eval_interval=TINY_EVAL_INTERVAL)
    uri = tracking_uri_in(tmp_path)
    common = dict(recipe=str(recipe), store_uri=s3_store, tracking_uri=uri, cache_dir=str(shared_cache),
                  output_dir=str(tmp_path / "out"))
    store = ArtifactStore(s3_store)

    command = [sys.executable, "-m", "flows.cli", "distill", "--recipe", str(recipe), "--run-id", "killed",
               "--store", s3_store, "--tracking-uri", uri, "--cache-dir", str(shared_cache),
               "--output-dir", str(tmp_path / "out")]
    # The session's Prefect server and Ray (as a deployment joins a running cluster): the killed driver's own Ray
    # would cost a start and its daemons' CPU, and a driver dying under a cluster that outlives it is the harder case.
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value(), "RAY_AUTH_MODE": "token",
                        "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    with open(tmp_path / "killed.log", "w") as log:
        killed_at = _kill_after_checkpoint(command, env, log, store, "killed", step=1)
    assert killed_at < ROLLOUTS and not (tmp_path / "out" / "killed" / "student").exists()

    resumed = distill(run_id="killed", **common)
    uninterrupted, _, _ = tiny_run

    expected = load_model(uninterrupted["student_dir"]).state_dict()
    for name, tensor in load_model(resumed["student_dir"]).state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                              filter_string="tags.`dmd2.run_id` = 'killed'")
    assert [r.info.run_id for r in runs] == [resumed["mlflow_run_id"]]
    for key in ["train/loss", "train/critic-loss", "time/rollout"]:
        steps = [m.step for m in client.get_metric_history(resumed["mlflow_run_id"], key)]
        assert sorted(steps) == list(range(ROLLOUTS)), key

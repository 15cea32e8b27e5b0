"""Deployments as a service (flows/prefect.yaml), end to end as a user runs them: a real `prefect server
start`, `prefect deploy` onto a `process` work pool, a `prefect worker`, and two `prefect deployment run`
triggers at once. The deployment runs one flow run at a time, so the second waits and then continues
the first's checkpoint; the MLflow run, the registered versions, their aliases and tags are checked."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from mlflow import MlflowClient
from prefect.client.orchestration import PrefectClient

from tests.flows.conftest import write_recipe

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrefectServer:
    """`prefect server start` on 127.0.0.1 with its own sqlite database under `home`."""

    def __init__(self, home: Path):
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_"))}
        self.env |= {"PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                     "PREFECT_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT),
                     # A run held back by the deployment's concurrency limit is tried again after 1 s, not 30 s.
                     "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                         "--port", str(port)], env=self.env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.api}/health", timeout=2) as answer:
                    if json.loads(answer.read()) is True:
                        return
            except OSError:
                pass
            assert self.process.poll() is None and time.monotonic() < deadline, "prefect server did not start"
            time.sleep(1)

    def cli(self, *args: str, timeout: float = 180) -> str:
        return self.wait(self.start_cli(*args), timeout)

    def start_cli(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def wait(command: subprocess.Popen, timeout: float = 180) -> str:
        out, err = command.communicate(timeout=timeout)
        assert command.returncode == 0, out + err
        return out

    def api_call(self, call):
        async def run():
            async with PrefectClient(self.api) as client:
                return await call(client)
        return asyncio.run(run())

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still up after a minute: what the test checks is done by then, and a
    Prefect worker under a loaded machine's full suite was seen taking longer than that to stop."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.slow
def test_two_triggers_of_a_pooled_deployment_run_one_after_the_other_and_register_their_students(
        tiny_teacher_dir, shared_ray, shared_cache, tmp_path):
    server = PrefectServer(tmp_path / "prefect")
    worker = None
    try:
        server.cli("work-pool", "create", "dmd2", "--type", "process")
        server.cli("deploy", "--prefect-file", "flows/prefect.yaml", "--all")
        nightly = server.api_call(lambda c: c.read_deployment_by_name("distill/digits-4step-nightly"))
        assert [(s.schedule.cron, s.active) for s in nightly.schedules] == [("0 3 * * *", False)]
        pooled = server.api_call(lambda c: c.read_deployment_by_name("distill/digits-4step"))
        assert pooled.work_pool_name == "dmd2" and pooled.global_concurrency_limit.limit == 1
        assert pooled.concurrency_options.collision_strategy == "ENQUEUE"

        recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=2)
        tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
        params = {"recipe": str(recipe), "run_id": "pooled", "store_uri": (tmp_path / "store").as_uri(),
                  "tracking_uri": tracking, "output_dir": str(tmp_path / "outputs"), "cache_dir": str(shared_cache)}
        args = [item for key, value in params.items() for item in ("--param", f"{key}={value}")]
        triggers = [server.start_cli("deployment", "run", "distill/digits-4step", *args, "--param", "more_rollouts=1")
                    for _ in range(2)]  # both at once: the second must wait for the first, then continue it by one
        # The flow runs join a running Ray cluster, as a deployment does in production (RAY_ADDRESS, token
        # authentication); here the session's, which also spares each run a Ray start.
        cluster = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
        # The worker looks for queued runs every second, not every 10 s: the second run starts when the first ends.
        polling = {"PREFECT_WORKER_QUERY_SECONDS": "1"}
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "dmd2"], cwd=ROOT,
                                  env=server.env | cluster | polling, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        for trigger in triggers:  # the worker starts meanwhile
            server.wait(trigger)
        deadline = time.monotonic() + 900
        while True:
            runs = server.api_call(lambda c: c.read_flow_runs())
            distills = [r for r in runs if r.name.startswith("distill-")]
            if len(distills) == 2 and all(r.state.is_final() for r in distills):
                break
            assert time.monotonic() < deadline, [(r.name, r.state.name) for r in distills]
            time.sleep(1)
        assert all(r.state.is_completed() for r in distills), [(r.name, r.state.message) for r in distills]
        first, second = sorted(distills, key=lambda r: r.start_time)
        assert second.start_time >= first.end_time  # one after the other
    finally:
        if worker is not None:
            stop_process(worker)
        server.stop()

    client = MlflowClient(tracking)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1]  # continued
    assert {f"prefect.flow_run.{first.id}", f"prefect.flow_run.{second.id}"} <= set(run.data.tags)
    versions = sorted(client.search_model_versions("name='pooled'"), key=lambda v: int(v.version))
    assert [int(v.version) for v in versions] == [1, 2]
    assert versions[1].tags["prefect.flow_run_id"] == str(second.id)
    assert versions[1].tags["dmd2.mlflow_run_id"] == run.info.run_id
    assert versions[1].tags["dmd2.student"].endswith("/pooled/student/2")
    champion = client.get_model_version_by_alias("pooled", "champion")
    figures = [float(v.tags["eval/fd_teacher"]) for v in versions]
    assert int(champion.version) == (2 if figures[1] < figures[0] else 1)  # the better student holds it

"""Fixtures shared by the end-to-end tests (tests/flows, tests/reliability): an in-process Prefect
server, moto's S3 server, a tiny teacher, one local Ray for the session (`shared_ray`: started after moto's
settings are in the environment, so that its workers inherit them) and one uninterrupted tiny run (`tiny_run`).

Ray, Prefect, boto3, moto and the store are imported inside the fixtures that use them, never at collection: the
GPU image has none of them, and its tests (marked gpu) must collect there (tests/bench/test_gpu_bench.py)."""

import os
from pathlib import Path

# Before torch loads OpenMP, which reads it once: idle threads sleep instead of spinning, in this process and in every
# process the tests start (they inherit the environment). Spinning threads in the lane, at idle priority beside a busy
# core, tripled a test's CPU time (tests/background.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from flows.prefect_env import apply_defaults  # noqa: E402

apply_defaults()  # before Prefect is imported: the tests' Prefect client and server are set up as dmd2's
_LANE_RESULT = pytest.StashKey[tuple[int, str] | None]()


def _waited_for(item) -> list[str]:
    """The background jobs test ``item`` waits for: its `waits_for(name)` marks (tests/background.py)."""
    return [mark.args[0] for mark in item.iter_markers("waits_for")]


def pytest_collection_modifyitems(items):
    """Tests that wait for a background job run last (the others in their order): by then it is done."""
    items.sort(key=lambda item: bool(_waited_for(item)))


def pytest_collection_finish(session):
    """Start the lane (tests/background.py) with its tests, and the background jobs that the tests left to run
    here wait for: ``BACKGROUND_JOBS[name]`` (Python code) of the waiting test's module."""
    from tests import background

    if session.config.option.collectonly:
        return
    if lane := background.split_lane(session.items):
        background.start_lane([item.nodeid for item in lane], session.config.rootpath)
    jobs = {name: item.module.BACKGROUND_JOBS[name] for item in session.items for name in _waited_for(item)}
    for name, code in jobs.items():
        background.start(name, code)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Wait for the lane, whose failures fail the session; end the jobs."""
    from tests import background

    interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
    session.config.stash[_LANE_RESULT] = lane = background.wait_lane(stop=interrupted)
    if lane is not None and lane[0] != 0 and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    background.stop_all()


def pytest_unconfigure(config):
    """The lane's own report, after the session's whole report: its last line sums up the lane's tests."""
    if (lane := config.stash.get(_LANE_RESULT, None)) is not None:
        writer = config.get_terminal_writer()
        writer.sep("=", f"the lane's tests, run beside the others (tests/background.py): exit code {lane[0]}")
        writer.write(lane[1])


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> str:
    """A freshly initialised tiny class-conditional digits UNet, saved as a diffusers directory."""
    from dmd2.families.digits.model import build_digits_unet

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "teacher"
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> "MotoServer":
    """moto's S3 server with a bucket, and the AWS settings in this process's environment."""
    import boto3

    from tests.infra.conftest import BUCKET, REGION, MotoServer, aws_test_settings

    server = MotoServer()
    with pytest.MonkeyPatch.context() as env:
        for name, value in aws_test_settings(server.endpoint, tmp_path_factory.mktemp("aws")).items():
            env.setenv(name, value)
        boto3.client("s3", region_name=REGION, endpoint_url=server.endpoint).create_bucket(Bucket=BUCKET)
        yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_store(s3_server) -> str:
    """A store prefix in the bucket of `s3_server`."""
    from tests.infra.conftest import BUCKET

    return f"s3://{BUCKET}/runs"


@pytest.fixture(scope="session")
def tiny_teacher_dir(tiny_teacher) -> Path:
    return Path(tiny_teacher)


@pytest.fixture(scope="session")
def _ray_for_the_session():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def start_shared_ray() -> None:
    """The session's local Ray, unless one is up: started as the flows start theirs (`ensure_ray`, token
    authentication) so that `distill` joins it. 12 logical CPUs: scheduling tokens, not cores (a rank sizes
    its threads by the machine), enough for the groups a module keeps up side by side (tests/infra/trainers/
    test_group.py: world size 1, 2 and 2 again, colocated: 2 + 4 + 4)."""
    import ray

    from infra.trainers.cluster import ensure_ray

    if not ray.is_initialized():
        with pytest.MonkeyPatch.context() as env:
            env.delenv("RAY_ADDRESS", raising=False)
            ensure_ray(num_cpus=12)


@pytest.fixture(scope="module")
def shared_ray(_ray_for_the_session, s3_server):
    """One local Ray for the session (each start costs ~10 s), started after moto's settings are in the
    environment, so that its workers inherit them. A module that needs a cluster of its own (a pretend GPU, two
    nodes) shuts it down; the next module to ask starts it again."""
    start_shared_ray()


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One families' cache for the session's runs: the digits evaluator is trained once, not once per run
    (a run's result does not depend on who trained it: it is seeded, and keyed by its data)."""
    return tmp_path_factory.mktemp("dmd2-cache")


@pytest.fixture(scope="session")
def tiny_run(prefect_server, s3_store, tiny_teacher_dir, _ray_for_the_session, shared_cache, tmp_path_factory):
    """The tiny recipe's run with nothing going wrong (run id "tiny", on S3): what the flow tests inspect, and
    the student that every interrupted or faulty run of the same recipe must equal, bit for bit (seeds come
    from the recipe, not the run id). Made once: a run costs a Ray group build and its evaluations.
    Returns (the distill result, the recipe, the MLflow tracking URI)."""
    from flows.distill import distill
    from tests.flows.conftest import TINY_EVAL_INTERVAL, TINY_ROLLOUTS, write_recipe
    from tests.tracking_db import tracking_uri_in

    start_shared_ray()
    tmp = tmp_path_factory.mktemp("tiny-run")
    recipe = write_recipe(tmp / "tiny.toml", tiny_teacher_dir, TINY_ROLLOUTS, eval_interval=TINY_EVAL_INTERVAL)
    uri = tracking_uri_in(tmp)
    result = distill(recipe=str(recipe), run_id="tiny", store_uri=s3_store, tracking_uri=uri,
                     cache_dir=str(shared_cache), output_dir=str(tmp / "out"))
    return result, recipe, uri

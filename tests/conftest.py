"""Fixtures shared by the end-to-end tests (tests/flows, tests/reliability): an in-process Prefect
server, moto's S3 server, a tiny teacher. Ray is started by the flow itself (ensure_ray) with the S3
settings already in the environment, so its workers inherit them."""

from pathlib import Path

from flows.prefect_env import apply_defaults

apply_defaults()  # before Prefect is imported: the tests' Prefect client and server are set up as dmd2's

import boto3  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from tests.infra.conftest import BUCKET, REGION, MotoServer, aws_test_settings  # noqa: E402
from tests.infra.trainers.ray_fixtures import tiny_teacher  # noqa: E402, F401  (a fixture)


@pytest.fixture(scope="session")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> MotoServer:
    """moto's S3 server with a bucket, and the AWS settings in this process's environment."""
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
    return f"s3://{BUCKET}/runs"


@pytest.fixture(scope="session")
def tiny_teacher_dir(tiny_teacher) -> Path:
    return Path(tiny_teacher)


@pytest.fixture(scope="module")
def fresh_ray():
    """The flow starts Ray itself; shut down any Ray another module left, and this one afterwards."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One families' cache for the session's runs: the digits evaluator is trained once, not once per run
    (a run's result does not depend on who trained it: it is seeded, and keyed by its data)."""
    return tmp_path_factory.mktemp("dmd2-cache")

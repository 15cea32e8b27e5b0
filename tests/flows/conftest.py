"""Fixtures for the flow tests: an in-process Prefect server, moto's S3 server, MLflow on sqlite, a
tiny teacher and recipe. Ray is started by the flow itself (ensure_ray) with the S3 settings already
in the environment, so its workers inherit them."""

from pathlib import Path

import boto3
import pytest
import ray
from prefect.testing.utilities import prefect_test_harness

from tests.infra.conftest import BUCKET, REGION, MotoServer, aws_test_settings
from tests.infra.trainers.ray_fixtures import tiny_teacher  # noqa: F401  (a fixture)

TINY_RECIPE = """
[model]
teacher = "{teacher}"
[student]
num_steps = 2
[optim]
lr = 1e-3
critic_lr = 2e-3
[dmd2]
critic_steps_per_rollout = 2
teacher_guidance_scale = 2.0
[train]
rollouts = {rollouts}
rollout_batch_size = 8
seed = 7
save_interval = 1
eval_interval = {eval_interval}
keep_rollouts = 2
[eval]
num_samples = 50
reference_steps = 4
"""


@pytest.fixture(scope="session")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """An S3 bucket on moto's server, with the AWS settings in this process's environment."""
    server = MotoServer()
    with pytest.MonkeyPatch.context() as env:
        for name, value in aws_test_settings(server.endpoint, tmp_path_factory.mktemp("aws")).items():
            env.setenv(name, value)
        boto3.client("s3", region_name=REGION, endpoint_url=server.endpoint).create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}/runs"
    server.stop()


@pytest.fixture(scope="session")
def tiny_teacher_dir(tiny_teacher) -> Path:
    return Path(tiny_teacher)


def write_recipe(path: Path, teacher: Path, rollouts: int, eval_interval: int = 0) -> Path:
    path.write_text(TINY_RECIPE.format(teacher=teacher, rollouts=rollouts, eval_interval=eval_interval))
    return path


@pytest.fixture(scope="module")
def fresh_ray():
    """The flow starts Ray itself; shut down any Ray another module left, and this one afterwards."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()

"""[cluster] resources: what each rank asks Ray for, and a rank promised a GPU that sees none."""

import time

import pytest
import ray

from dmd2.config import ClusterConfig
from infra.trainers.cluster import rank_resources
from infra.trainers.stages import build_groups
from tests.infra.trainers.ray_fixtures import new_store, run_spec, tiny_config, tiny_teacher  # noqa: F401


@pytest.fixture(scope="module")
def ray_with_a_pretend_gpu():
    """A local Ray that advertises one GPU on this CPU-only machine (as a node with a broken driver would)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_colocated_groups_share_each_gpu_and_the_default_follows_the_cluster(ray_with_a_pretend_gpu):
    assert rank_resources(ClusterConfig(), groups=2).num_gpus == 0.5  # the cluster has a GPU: 1 per rank, shared
    assert rank_resources(ClusterConfig(colocate=False), groups=2).num_gpus == 1.0
    assert rank_resources(ClusterConfig(gpus_per_rank=0), groups=2).num_gpus == 0.0
    assert rank_resources(ClusterConfig(cpus_per_rank=3), groups=2).num_cpus == 3
    assert rank_resources(ClusterConfig(), groups=2).bundle(2) == {"CPU": 2.0, "GPU": 1.0}


def test_a_rank_given_a_gpu_that_sees_none_fails_at_once_naming_the_option(ray_with_a_pretend_gpu, tiny_teacher,
                                                                           tmp_path):
    config = tiny_config(tiny_teacher, 1)  # [cluster] defaults: the cluster has a GPU, so each rank asks for it
    with pytest.raises(Exception, match=r"was given 0.5 GPU by Ray but torch sees none.*\[cluster\] gpus_per_rank = 0"):
        build_groups(run_spec(config), new_store(tmp_path))
    deadline = time.monotonic() + 30  # Ray returns a removed placement group's resources asynchronously
    while ray.available_resources().get("GPU") != 1.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 1.0  # the placement group was given back

"""[cluster] resources: what each rank asks Ray for, what can never be placed, a rank promised a GPU that sees
none, two ranks on one GPU, the driver's collective settings, and model folders a node cannot see."""

import os
import time

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from dmd2.config import ClusterConfig
from dmd2.config import ConfigError
from infra.trainers.cluster import (RankResources, check_folders_on_every_node, placeable_bundles,
                                    rank_placement_group, rank_resources)
from infra.trainers.group import check_distinct_devices, start_rank_processes
from infra.trainers.stages import build_groups
from tests.infra.trainers.ray_fixtures import new_store, run_spec, tiny_config


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


def test_on_a_local_ray_the_default_cpus_are_an_equal_share_when_the_ranks_outnumber_them(ray_with_a_pretend_gpu,
                                                                                         monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert rank_resources(ClusterConfig(), groups=2, world_size=2).num_cpus == 1.0  # 4 ranks, 4 CPUs
    assert rank_resources(ClusterConfig(), groups=2, world_size=3).num_cpus == 0.6666  # 6 ranks share 4 CPUs
    assert rank_resources(ClusterConfig(cpus_per_rank=3), groups=2, world_size=3).num_cpus == 3  # as asked
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # a joined cluster may grow: 1 CPU per rank, as before
    assert rank_resources(ClusterConfig(), groups=2, world_size=3).num_cpus == 1.0


def test_bundles_a_local_ray_can_never_hold_are_refused_at_once(ray_with_a_pretend_gpu, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # One node of 4 CPUs and 1 GPU: 4 bundles of 1 CPU, 1 of a GPU, 2 of 2 CPUs; one per node when spread strictly.
    assert placeable_bundles({"CPU": 1.0}, "PACK") == 4
    assert placeable_bundles({"CPU": 1.0, "GPU": 1.0}, "PACK") == 1
    assert placeable_bundles({"CPU": 2.0}, "SPREAD") == 2
    assert placeable_bundles({"CPU": 1.0}, "STRICT_SPREAD") == 1
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"\[train\] world_size = 3 needs 3 bundles of \{'CPU': 2.0, 'GPU': 1.0\}.*"
                                          r"\(with CPU 4, GPU 1\) can hold 1: lower \[train\] world_size"):
        rank_placement_group(3, RankResources(num_cpus=1.0, num_gpus=0.5), groups=2)
    with pytest.raises(ConfigError, match=r"world_size = 2 .*STRICT_SPREAD.*can hold 1"):
        rank_placement_group(2, RankResources(num_cpus=1), strategy="STRICT_SPREAD")
    assert time.monotonic() - began < 5  # not the 120 s wait for a placement that never comes
    group = rank_placement_group(4, RankResources(num_cpus=1))  # what fits is still placed
    ray.util.remove_placement_group(group)


def test_the_drivers_collective_settings_reach_every_rank_process(ray_with_a_pretend_gpu, monkeypatch):
    """Set after Ray started (so not inherited from the raylet): NCCL's and gloo's variables reach the ranks,
    the driver's other variables do not."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth8")
    monkeypatch.setenv("DMD2_TEST_NOT_FORWARDED", "1")
    processes = start_rank_processes(2, RankResources(num_cpus=0.5))
    try:
        seen = ray.get([process.__ray_call__.remote(
            lambda _: {name: os.environ.get(name)
                       for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "DMD2_TEST_NOT_FORWARDED")})
            for process in processes])
    finally:
        for process in processes:
            ray.kill(process)
    assert seen == [{"NCCL_SOCKET_IFNAME": "eth7", "GLOO_SOCKET_IFNAME": "eth8", "DMD2_TEST_NOT_FORWARDED": None}] * 2


def test_ranks_of_one_group_on_one_gpu_are_refused_naming_them():
    check_distinct_devices("critic", ["GPU-a", "GPU-b", None, None])  # CPU ranks share the host by design
    with pytest.raises(RuntimeError, match=r"critic group's ranks share GPUs \(ranks 0, 2 on GPU GPU-a\)"):
        check_distinct_devices("critic", ["GPU-a", "GPU-b", "GPU-a", "GPU-c"])


def test_a_model_folder_a_node_cannot_see_is_refused_naming_the_node_before_any_rank_starts(ray_with_a_pretend_gpu,
                                                                                            tmp_path):
    group = rank_placement_group(2, RankResources(num_cpus=1))
    try:
        check_folders_on_every_node(group, [str(tmp_path)])  # every node sees it
        with pytest.raises(ConfigError, match=rf"cannot see the model folders .*: {tmp_path / 'gone'} on "
                                              rf"{ray.util.get_node_ip_address()}-\w+\. .*same absolute path"):
            check_folders_on_every_node(group, [str(tmp_path), str(tmp_path / "gone")])
    finally:
        remove_placement_group(group)

"""Trainer groups across machines: Ray's simulated two-node cluster on this machine.

Its own Ray (a `ray.cluster_utils.Cluster`, joined through RAY_ADDRESS as a real cluster would be),
started after the other modules' local Ray is shut down.
"""

import pytest
import ray
from ray.cluster_utils import Cluster

from infra.trainers.cluster import RankResources, ensure_ray, first_bundle_on_each_node
from infra.trainers.stages import build_groups, run_rollout_on_groups
from tests.infra.trainers.ray_fixtures import run_spec, new_store, tiny_config


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    cluster.wait_for_nodes()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", cluster.address)
        ensure_ray()  # joins the running cluster instead of starting a local Ray
        yield cluster
    ray.shutdown()
    cluster.shutdown()


def train_on(task, store, strategy: str) -> tuple[list[str], dict[str, list[str]]]:
    """Two rollouts at world size 2; returns the actor ranks' node ids and every group's state digests. Checks
    that the ranks chosen to log system metrics (one per node: `first_bundle_on_each_node`) are the first rank
    on each node, as the ranks themselves report their nodes."""
    groups = build_groups(task, store, RankResources(num_cpus=0.5), strategy=strategy)
    try:
        for rollout_id in range(2):
            run_rollout_on_groups(groups, "run", rollout_id)
        assert groups.critic.node_ids() == groups.actor.node_ids()  # rank i of both groups on bundle i
        nodes = groups.actor.node_ids()
        first = {node: nodes.index(node) for node in nodes}
        assert {rank: label[-6:] for rank, label in first_bundle_on_each_node(groups.placement).items()} == {
            rank: node[:6] for node, rank in first.items()}
        return groups.actor.node_ids(), {g.role: g.state_digests() for g in groups.in_order()}
    finally:
        groups.shutdown()


def test_ranks_on_two_nodes_train_exactly_as_on_one(two_nodes, tiny_teacher, tmp_path):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    task = run_spec(tiny_config(tiny_teacher, 2))
    one_node, packed = train_on(task, new_store(tmp_path / "packed"), "STRICT_PACK")
    two_node, spread = train_on(task, new_store(tmp_path / "spread"), "STRICT_SPREAD")
    assert len(set(one_node)) == 1 and len(set(two_node)) == 2
    custom = {n["NodeID"]: {"node_a", "node_b"} & set(n["Resources"]) for n in ray.nodes() if n["Alive"]}
    assert set().union(*(custom[node] for node in two_node)) == {"node_a", "node_b"}
    assert spread == packed

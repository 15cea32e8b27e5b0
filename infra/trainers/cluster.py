"""Ray: join the cluster named by RAY_ADDRESS or start a local one, and place ranks on it.

Both trainer groups can share the same accelerators: one placement group with a bundle per rank,
sized for every group that shares it, and rank i of each group on bundle i (fractional GPUs per rank).
"""

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from dmd2.config import ClusterConfig

logger = logging.getLogger(__name__)


def ensure_ray(num_cpus: int | None = None, **init_kwargs) -> None:
    """Connect to ``RAY_ADDRESS`` when it is set, else start a local Ray; no-op when connected.

    ``num_cpus`` applies to a local start only (default: the machine's cores). The project's packages
    must be importable on every node (installed there); Ray puts the driver's working directory on the
    workers' path for a local start.
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, **init_kwargs)
        return
    logger.info("starting a local Ray (RAY_ADDRESS is not set)")
    ray.init(num_cpus=num_cpus, include_dashboard=False, **init_kwargs)


@dataclass(frozen=True)
class RankResources:
    """What one rank of one group asks for: CPUs, GPUs (fractional when groups share a GPU), custom."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    def bundle(self, groups: int) -> dict[str, float]:
        """A placement bundle holding rank i of ``groups`` colocated groups."""
        bundle = {"CPU": self.num_cpus * groups, **{k: v * groups for k, v in self.custom.items()}}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus * groups
        return bundle


def rank_placement_group(world_size: int, per_rank: RankResources, groups: int = 1, strategy: str = "PACK",
                         timeout_s: float = 120.0) -> PlacementGroup:
    """A ready placement group of ``world_size`` bundles; rank i of every sharing group goes on bundle i.

    ``strategy``: PACK (as few nodes as possible), SPREAD, or STRICT_SPREAD (each rank on its own node).
    """
    bundles = [per_rank.bundle(groups) for _ in range(world_size)]
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {world_size} bundles of {bundles[0]} ({strategy}) within {timeout_s:.0f}s; "
            f"the cluster has {ray.available_resources()}: lower [train] world_size or the per-rank resources, "
            "or add nodes"
        )
    return group


def rank_resources(cluster: ClusterConfig, groups: int) -> RankResources:
    """What one rank of one of `groups` groups asks for, from `[cluster]` and what the Ray cluster has.

    Colocated, the groups' rank i share bundle i's GPUs (each rank asks gpus_per_rank / groups: Ray's
    fractional GPUs); otherwise each rank asks for its own. Ray gives each rank its GPUs through
    CUDA_VISIBLE_DEVICES, so a rank's device is always its cuda:0.
    """
    gpus = cluster.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    return RankResources(num_cpus=cluster.cpus_per_rank, num_gpus=gpus / groups if cluster.colocate else gpus)

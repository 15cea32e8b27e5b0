"""Ray: join the cluster named by RAY_ADDRESS or start a local one, and place ranks on it.

A local Ray this project starts keeps token authentication on: whoever can reach a Ray cluster's
ports can run code as its user, so every client must present the cluster's token. Ray (2.59 and
later) turns it on for a new local cluster unless RAY_AUTH_MODE says otherwise; `ensure_ray` refuses
RAY_AUTH_MODE=disabled, and checks that the cluster came up with it. The token is Ray's own: from
RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH when set, else ~/.ray/auth_token, which `ensure_ray` creates
(or keeps) readable by its owner only: Ray writes it with the umask's permissions, often readable by
all. The token is never logged; the workers of a local Ray read it as the driver does.

Both trainer groups can share the same accelerators: one placement group with a bundle per rank,
sized for every group that shares it, and rank i of each group on bundle i (fractional GPUs per rank).
"""

import logging
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dmd2.config import ClusterConfig, ConfigError

logger = logging.getLogger(__name__)

AUTH_MODE_SETTING = "RAY_AUTH_MODE"
# A local Ray's GCS dies with the run's process group (a closed terminal, a stopped service): Ray calls made after it
# (the groups' shutdown) wait this long for it to come back before they fail, 60 s by default; a local one never does.
GCS_RECONNECT_SETTING, LOCAL_GCS_RECONNECT_S = "RAY_gcs_rpc_server_reconnect_timeout_s", "10"
TOKEN_SETTINGS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # Ray reads these before its default file


def ensure_ray(num_cpus: int | None = None, **init_kwargs) -> None:
    """Connect to ``RAY_ADDRESS`` when it is set, else start a local Ray with token authentication;
    no-op when connected.

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
    prepare_token_auth()
    os.environ.setdefault(GCS_RECONNECT_SETTING, LOCAL_GCS_RECONNECT_S)  # the driver's, and the local workers'
    logger.info("starting a local Ray with token authentication (RAY_ADDRESS is not set)")
    ray.init(num_cpus=num_cpus, include_dashboard=False, **init_kwargs)
    if os.environ.get(AUTH_MODE_SETTING, "").lower() != "token":  # Ray sets it when it turns token auth on
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} started a local cluster without token authentication; set "
                           f"{AUTH_MODE_SETTING}=token, or join a cluster you run yourself with RAY_ADDRESS")


def default_token_file() -> Path:
    """Where Ray looks for its token when neither TOKEN_SETTINGS is set."""
    return Path.home() / ".ray" / "auth_token"


def prepare_token_auth() -> None:
    """Refuse a local start without token authentication; make Ray's default token file private to its owner."""
    mode = os.environ.get(AUTH_MODE_SETTING)
    if mode is not None and mode.lower() != "token":
        raise ConfigError(f"{AUTH_MODE_SETTING}={mode}: the local Ray this project starts keeps token authentication "
                          f"on (without it, anyone who reaches its ports can run code as you); unset "
                          f"{AUTH_MODE_SETTING} or set it to token, or set RAY_ADDRESS to join a cluster you run")
    if any(os.environ.get(name) for name in TOKEN_SETTINGS):
        return
    path = default_token_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Written aside and linked into place: two local starts at once (two runs on one host) must never read
    # a token file the other has created but not yet written. link(2) refuses an existing name: one wins.
    staging = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32))  # Ray's own format: 256 random bits in hex
        os.link(staging, path)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            logger.warning("%s was readable by other users; made it readable by its owner only", path)
            path.chmod(0o600)
    finally:
        staging.unlink()


@dataclass(frozen=True)
class RankResources:
    """What one rank of one group asks for: CPUs, GPUs (fractional when groups share a GPU), custom."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    def times(self, groups: int) -> "RankResources":
        """What rank i of ``groups`` colocated groups asks for together (a process holding all of them)."""
        return RankResources(self.num_cpus * groups, self.num_gpus * groups,
                             {name: amount * groups for name, amount in self.custom.items()})

    def bundle(self, groups: int) -> dict[str, float]:
        """A placement bundle holding rank i of ``groups`` colocated groups."""
        together = self.times(groups)
        return {"CPU": together.num_cpus, **together.custom, **({"GPU": together.num_gpus} if self.num_gpus else {})}


def is_local_cluster() -> bool:
    """Whether the Ray this process uses is the local one `ensure_ray` starts (no RAY_ADDRESS): its size is
    fixed, so what does not fit now never will. A joined cluster may grow (an autoscaler adds nodes)."""
    return not os.environ.get("RAY_ADDRESS")


def placeable_bundles(bundle: dict[str, float], strategy: str) -> int:
    """How many copies of ``bundle`` the cluster's alive nodes can hold at most (their total resources, not
    what is free now); STRICT_SPREAD puts at most one on a node."""
    count = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        fits = min((int(have.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items() if amount > 0),
                   default=0)
        count += min(fits, 1) if strategy == "STRICT_SPREAD" else fits
    return count


def rank_placement_group(world_size: int, per_rank: RankResources, groups: int = 1, strategy: str = "PACK",
                         timeout_s: float = 120.0) -> PlacementGroup:
    """A ready placement group of ``world_size`` bundles; rank i of every sharing group goes on bundle i.

    ``strategy``: PACK (as few nodes as possible), SPREAD, or STRICT_SPREAD (each rank on its own node).
    On a local Ray, bundles that its nodes could never hold are refused at once (`ConfigError`); on a joined
    cluster they are waited for up to ``timeout_s`` (its autoscaler may add nodes).
    """
    bundles = [per_rank.bundle(groups) for _ in range(world_size)]
    if is_local_cluster() and (room := placeable_bundles(bundles[0], strategy)) < world_size:
        total = ray.cluster_resources()
        has = ", ".join(f"{name} {total.get(name, 0):g}" for name in bundles[0])
        raise ConfigError(
            f"[train] world_size = {world_size} needs {world_size} bundles of {bundles[0]} ({groups} colocated "
            f"group(s) per rank, {strategy}), but this machine's local Ray (with {has}) can hold {room}: lower "
            "[train] world_size or [cluster] cpus_per_rank / gpus_per_rank (or leave them unset: the defaults fit "
            "the machine), or join a larger cluster with RAY_ADDRESS")
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


def first_bundle_on_each_node(group: PlacementGroup) -> dict[int, str]:
    """{bundle index: node label} for the lowest bundle of ``group`` on each node it spans; the label is the
    node's IP and the start of its Ray node id (`ray list nodes`), unique even for nodes sharing a host."""
    first: dict[str, int] = {}
    for bundle, node in sorted(placement_group_table(group)["bundles_to_node_id"].items()):
        first.setdefault(node, bundle)
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return {bundle: f"{ips.get(node, 'node')}-{node[:6]}" for node, bundle in first.items()}


def check_folders_on_every_node(group: PlacementGroup, folders: list[str], timeout_s: float = 120.0) -> None:
    """``ConfigError`` naming each node of ``group`` that cannot see one of ``folders`` (the model folders its
    ranks will load, as the driver names them), asked by a task on each node before any rank process starts: a
    rank that found one missing would fail only after the others had loaded, with a message about its own node."""
    if not folders:
        return
    asked = {node: _missing_folders.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                 group, placement_group_bundle_index=bundle)).remote(folders)
             for bundle, node in first_bundle_on_each_node(group).items()}
    lacking = [f"{path} on {node}" for node, ref in asked.items() for path in ray.get(ref, timeout=timeout_s)]
    if lacking:
        raise ConfigError(f"the ranks cannot see the model folders they are to load: {'; '.join(lacking)}. A model "
                          "given as a local folder ([model] teacher, student, critic_load) must be at the same "
                          "absolute path on every node: copy it there, put it on a filesystem every node mounts, "
                          "or give a hub id")


@ray.remote(num_cpus=0)
def _missing_folders(folders: list[str]) -> list[str]:
    return [folder for folder in folders if not os.path.isdir(folder)]


def rank_memory(cluster: ClusterConfig, timeout_s: float = 120.0) -> tuple[str | None, int]:
    """The memory one GPU's pair of ranks (rank i of each group) has: ("GPU", the total bytes of a GPU, asked of one
    through Ray) when the ranks take GPUs; ("host", the bytes available on this machine now) for CPU ranks on a
    local Ray; (None, 0) for CPU ranks on a joined cluster, whose nodes' memory is not known here, or when no GPU
    answers within ``timeout_s`` (all busy: the groups will wait for them too)."""
    gpus = cluster.gpus_per_rank
    if gpus is None:  # as `rank_resources` decides it
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    if gpus > 0:
        asked = _gpu_memory.remote()
        try:
            return "GPU", ray.get(asked, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(asked)
            logger.warning("no GPU could be asked its memory within %.0f s (all busy?): the run's memory plan is "
                           "not checked against its GPUs", timeout_s)
            return None, 0
    if is_local_cluster():
        import psutil

        return "host", psutil.virtual_memory().available
    return None, 0


@ray.remote(num_gpus=1, num_cpus=0)
def _gpu_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def rank_resources(cluster: ClusterConfig, groups: int, world_size: int = 1) -> RankResources:
    """What one rank of one of `groups` groups of `world_size` ranks asks for, from `[cluster]` and what the Ray
    cluster has.

    CPUs default to 1 per rank; on a local Ray with fewer CPUs than the run's ranks, to an equal share of its
    CPUs (floored to Ray's 1e-4 granularity), so that any world size places on a small machine.

    Colocated, the groups' rank i share bundle i's GPUs (each rank asks gpus_per_rank / groups: Ray's
    fractional GPUs); otherwise each rank asks for its own. Ray gives each rank its GPUs through
    CUDA_VISIBLE_DEVICES, so a rank's device is always its cuda:0.
    """
    gpus = cluster.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    cpus = cluster.cpus_per_rank
    if cpus is None:
        ranks, have = world_size * groups, ray.cluster_resources().get("CPU", 0.0)
        cpus = 1.0 if not is_local_cluster() or have >= ranks else math.floor(have / ranks * 1e4) / 1e4
    return RankResources(num_cpus=cpus, num_gpus=gpus / groups if cluster.colocate else gpus)

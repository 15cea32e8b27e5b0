"""A trainer group: N rank workers training one model data-parallel, each in a Ray actor (`RankProcess`).

Rank i of every group placed together shares one process: torch, diffusers and the model code are imported
once per rank rather than once per group (~8 s of CPU each), a GPU holds one CUDA context, and the groups share
one process group (their stages never overlap). Every method runs on all ranks and returns one small value per
rank (an `ArtifactRef`, a `TrainResult`, a dict of numbers): payloads stay in the artifact store, written and
read by the ranks. Per-rank inputs are lists indexed by rank; rank i of a later group receives rank i's output of
every earlier group (`external_data`), which works because both groups share the world size and the rollout's
shard layout.
"""

import logging
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import ray
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dmd2.failures import RunError
from dmd2.family import ModelFamily, RunSpec
from infra.trainers.cluster import RankResources
from infra.trainers.hooks import resolve_hooks
from infra.trainers.rank import RankWorker, TrainResult
from infra.trainers.student_outputs import EvalResult
from infra.store import ArtifactRef, ArtifactStore
from infra.tracking.system import SystemMetrics
from infra.trainers.configs import TrainerConfig

logger = logging.getLogger(__name__)

__all__ = ["EvalResult", "RankLostError", "RecoverableError", "TrainerGroup", "TrainResult"]

# How long the other ranks get to report after one failed, so that a dead rank is named as the cause
# rather than the peer whose collective it broke.
SETTLE_S = 10.0
# What a broken or timed-out collective looks like on a surviving rank: gloo raises a plain RuntimeError
# (NCCL a DistBackendError, or its watchdog ends the process).
BROKEN_COLLECTIVE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")


def death_note(died: ray.exceptions.RayActorError) -> str:
    """What Ray knows of a dead rank, and where its own last words are: its process's log, which holds the
    Python stack of every thread when it crashed in native code (`RankWorker` enables faulthandler)."""
    text = str(died)
    first = text.splitlines()[0]
    pid, ip = re.search(r"\bpid: (\d+)", text), re.search(r"\bip: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.+?\.)(?:\s|$)", text)
    note = f"{type(died).__name__}: {detail.group(1) if detail else first}"
    if pid:
        where = f" on {ip.group(1)}" if ip else ""
        note += (f"; its process was pid {pid.group(1)}{where}, whose log is worker-*-{pid.group(1)}.err in "
                 "Ray's session logs there (by default /tmp/ray/session_latest/logs)")
    return note


class RecoverableError(RunError):
    """The run's trainer groups cannot go on, but new ones loaded from its last checkpoint can."""


class RankLostError(RecoverableError):
    """A rank of a group died (its process is gone), or a collective between the ranks broke."""


def _broken_collective(error: BaseException) -> bool:
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError)
                                                 and any(sign in str(error) for sign in BROKEN_COLLECTIVE))


def _forwarded(name: str):
    def method(self: "RankProcess", role: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workers[role], name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


def _with_rank_worker_methods(cls: type) -> type:
    """``cls`` with every public `RankWorker` method but `shutdown` forwarded to the worker of the role given first."""
    for name in dir(RankWorker):  # its own and `StudentOutputs`'
        if callable(getattr(RankWorker, name)) and not name.startswith("_") and name != "shutdown":
            setattr(cls, name, _forwarded(name))
    return cls


@_with_rank_worker_methods
class RankProcess:
    """The Ray actor of rank i: the `RankWorker` of each group that shares it, by role. Each method of
    `RankWorker` is here too, taking the role first, so that Ray titles the process `ray::RankProcess.<method>`
    while it runs (what `ps` shows)."""

    def __init__(self):
        self.workers: dict[str, RankWorker] = {}

    def warm(self, family: ModelFamily, model_path: str) -> None:
        """Import the model's code and build its architecture on the meta device (no weight is read), while the
        driver plans the run and sets up MLflow (`infra.trainers.stages.start_ranks`). Only a head start: what
        fails here fails again in `setup`, which reports it."""
        try:
            family.model_on_meta(model_path)
        except Exception as error:
            logger.info("warm-up of %s skipped: %s", model_path, error)

    def add(self, role: str, *worker_args: Any) -> None:
        self.workers[role] = RankWorker(*worker_args)
        self.workers[role].colocated = self.workers  # each sees the others (the actor's evaluation borrows a teacher)

    def remove(self, role: str) -> int:
        """End ``role``'s worker (it leaves the process group if it is the last); how many workers are left."""
        worker = self.workers.pop(role)
        worker.shutdown(leave_process_group=not self.workers)
        return len(self.workers)


# The driver's settings of the collectives' libraries, which a rank on another node would not otherwise see
# (Ray's workers inherit the environment of the node's raylet, not the driver's): NCCL_SOCKET_IFNAME,
# NCCL_IB_HCA, NCCL_DEBUG, TORCH_NCCL_..., GLOO_SOCKET_IFNAME.
FORWARDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_")


def forwarded_env() -> dict[str, str]:
    """The driver's variables of `FORWARDED_ENV_PREFIXES`, for every rank process."""
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIXES)}


def start_rank_processes(world_size: int, resources: RankResources,
                         placement: PlacementGroup | None = None) -> list[ray.actor.ActorHandle]:
    """One `RankProcess` per rank, asking ``resources``: rank i on bundle i of ``placement`` (when given), with
    the driver's `forwarded_env`."""
    actor_class, processes = ray.remote(RankProcess), []
    env = forwarded_env()
    runtime_env = {"runtime_env": {"env_vars": env}} if env else {}  # none: Ray reuses its ready workers
    for rank in range(world_size):
        strategy = (PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank)
                    if placement is not None else "DEFAULT")
        processes.append(actor_class.options(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus,
                                             resources=dict(resources.custom), scheduling_strategy=strategy,
                                             **runtime_env).remote())
    return processes


def check_distinct_devices(role: str, devices: list[str | None]) -> None:
    """``RuntimeError`` naming the ranks of ``role``'s group whose GPUs (by UUID) are one: two ranks of a group
    on one GPU would each size their work for a whole GPU (Ray's fractional GPUs have been seen to ignore
    placement bundles). CPU ranks (None) share the host by design."""
    ranks_of: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        if device is not None:
            ranks_of.setdefault(device, []).append(rank)
    shared = {device: ranks for device, ranks in ranks_of.items() if len(ranks) > 1}
    if shared:
        listed = "; ".join(f"ranks {', '.join(map(str, ranks))} on GPU {device}" for device, ranks in shared.items())
        raise RuntimeError(f"the {role} group's ranks share GPUs ({listed}): each rank needs a GPU of its own. "
                           "Check [cluster] gpus_per_rank and the nodes' GPUs as Ray reports them (ray status)")


class TrainerGroup:
    """``world_size`` ranks of ``trainer.role``, joined by torch.distributed and ready to train.

    ``processes``: the `RankProcess` of each rank, shared with other groups (`build_groups`); without them
    the group starts its own, rank i on bundle i of ``placement`` (or where Ray finds ``resources``). With
    ``wait=False`` the rank workers are only started: `join` and `wait_ready` finish the group, so that
    several groups can start, load and join side by side. ``system_metrics``: by rank, the ranks that log
    their node's system metrics (`infra.tracking.system`).
    """

    def __init__(self, trainer: TrainerConfig, spec: RunSpec, store: ArtifactStore, world_size: int,
                 resources: RankResources = RankResources(), placement: PlacementGroup | None = None,
                 num_threads: int = 1, system_metrics: Mapping[int, SystemMetrics] | None = None, wait: bool = True,
                 processes: list[ray.actor.ActorHandle] | None = None):
        if world_size != spec.config.train.world_size:
            raise ValueError(f"a {trainer.role} group of world size {world_size} cannot run a rollout planned for "
                             f"[train] world_size = {spec.config.train.world_size}: make them equal")
        resolve_hooks(trainer.hooks, trainer.role)  # a bad hook path fails here, before any rank worker starts
        self.role, self.world_size, self.store = trainer.role, world_size, store
        system_metrics = system_metrics or {}
        self.processes = processes or start_rank_processes(world_size, resources, placement)
        self._adding = [process.add.remote(self.role, trainer, spec, store, rank, world_size, num_threads,
                                           resources.num_gpus, system_metrics.get(rank))
                        for rank, process in enumerate(self.processes)]
        self.rendezvous: tuple[str, int] | None = None
        self._joining: list[ray.ObjectRef] = []
        if wait:
            self.join().wait_ready()

    def join(self, taken: Collection[tuple[str, int]] = ()) -> "TrainerGroup":
        """Start the rendezvous: rank 0 names an address, then every rank joins the process group and loads
        its models, in the background. `taken`: other groups' rendezvous, which this one must not reuse (two
        groups starting together could both be offered the same free port)."""
        ray.get(self._adding)  # a rank worker that could not be made fails here
        self.rendezvous = ray.get(self.processes[0].master_address.remote(self.role))
        while self.rendezvous in taken:
            self.rendezvous = ray.get(self.processes[0].master_address.remote(self.role))
        self._joining = [p.setup.remote(self.role, *self.rendezvous) for p in self.processes]
        return self

    def wait_ready(self) -> "TrainerGroup":
        """Block until every rank has joined and loaded (a rank's failure to do either is raised here)."""
        if self.rendezvous is None:
            self.join()
        ray.get(self._joining)
        check_distinct_devices(self.role, self._each("device_uuid"))
        logger.info("%s group ready: %d ranks, rendezvous %s:%d", self.role, self.world_size, *self.rendezvous)
        return self

    def _each(self, method: str, *shared: Any, **per_rank: list[Any]) -> list[Any]:
        """Call ``method(*shared, **{name: values[i]})`` on every rank i and wait for all."""
        for name, values in per_rank.items():
            if len(values) != self.world_size:
                raise ValueError(f"{self.role}.{method}: {name} has {len(values)} entries for "
                                 f"{self.world_size} ranks (one per rank)")
        calls = []
        for i, process in enumerate(self.processes):
            own = {name: values[i] for name, values in per_rank.items()}
            calls.append(getattr(process, method).remote(self.role, *shared, **own))
        try:
            return ray.get(calls)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
            cause = self._cause(method, calls, error)
            if cause is error:
                raise
            raise cause from error

    def _cause(self, method: str, calls: list[ray.ObjectRef], error: Exception) -> BaseException:
        """What a failed call on the ranks means: a lost rank (`RankLostError`), one of the run's own
        errors (its message is the story), or the rank's exception as Ray reports it."""
        ray.wait(calls, num_returns=len(calls), timeout=SETTLE_S)
        for rank, call in enumerate(calls):
            try:
                ray.get(call, timeout=0)
            except ray.exceptions.RayActorError as died:
                return RankLostError(f"{self.role} rank {rank} died during {method} ({death_note(died)})")
            except Exception:
                continue
        cause = getattr(error, "cause", error)
        if _broken_collective(cause):
            return RankLostError(f"a collective of the {self.role} group broke during {method}: "
                                 f"{str(cause).splitlines()[0]}")
        return cause if isinstance(cause, RunError) else error

    def rollout(self, run_id: str, rollout_id: int) -> list[ArtifactRef]:
        """Each rank's backward-simulated student samples (RolloutSamples)."""
        return self._each("rollout", run_id, rollout_id)

    def convert(self, run_id: str, rollout_id: int, samples: list[ArtifactRef]) -> list[ArtifactRef]:
        """Each rank's samples as train pairs (TrainPairs)."""
        return self._each("convert", run_id, rollout_id, samples=samples)

    def train(self, run_id: str, rollout_id: int, pairs: list[ArtifactRef],
              external_data: dict[str, list[ArtifactRef]] | None = None) -> list[TrainResult]:
        """The group's optimizer steps of one rollout; rank i sees ``{role: refs[i]}`` of ``external_data``."""
        external = external_data or {}
        if self.role in external:
            raise ValueError(f"the {self.role} group cannot receive its own output as external_data")
        per_rank = [{role: refs[i] for role, refs in external.items()} for i in range(self.world_size)]
        for role, refs in external.items():
            if len(refs) != self.world_size:
                raise ValueError(f"external_data[{role!r}] has {len(refs)} refs for {self.world_size} ranks: "
                                 "groups of one rollout must share the world size")
        return self._each("train", run_id, rollout_id, pairs=pairs, external_data=per_rank)

    def score(self, run_id: str, rollout_id: int, kept: list[ArtifactRef],
              pairs: list[ArtifactRef]) -> list[ArtifactRef]:
        """The teacher's scores of each rank's kept scoring inputs (Scores)."""
        return self._each("score", run_id, rollout_id, kept=kept, pairs=pairs)

    def sleep(self) -> list[dict[str, int]]:
        """Weights and optimizer state leave the accelerator (every stage wakes the group on use)."""
        return self._each("sleep")

    def awake(self) -> bool:
        """Whether any rank of the group holds its weights on its accelerator now."""
        return any(self._each("awake"))

    def wake(self) -> list[None]:
        return self._each("wake")

    def save(self, run_id: str, step: int, linked: dict[str, ArtifactRef] | None = None) -> list[ArtifactRef]:
        """Checkpoint at ``<run_id>/<checkpoint_dir>/<step>``; every rank returns the same ref."""
        return self._each("save", run_id, step, linked)

    def load(self, checkpoint: ArtifactRef) -> list[dict[str, ArtifactRef]]:
        """Load a checkpoint of this role on every rank; returns the linked checkpoints' refs per rank."""
        return self._each("load", checkpoint)

    def retune(self, seed: int, lr_factor: float) -> list[None]:
        """Every rank draws its rollouts from `seed` and trains at `lr_factor` x the recipe's learning rates."""
        return self._each("retune", seed, lr_factor)

    def evaluate(self, run_id: str, step: int, with_baselines: bool = False) -> EvalResult:
        """The family's evaluation of the group's model, run on rank 0 (every rank takes part)."""
        return self._each("evaluate", run_id, step, with_baselines)[0]

    def reference_media(self, run_id: str) -> ArtifactRef | None:
        """The evaluator's pictures to show once beside the student's, stored by rank 0 (None: none)."""
        return self._each("reference_media", run_id)[0]

    def export(self, run_id: str, step: int, card: dict[str, Any]) -> ArtifactRef:
        """The family's export of the group's model at ``<run_id>/student/<step>`` in the store."""
        return self._each("export", run_id, step, card)[0]

    def export_weights(self, key: str, ema: bool = False) -> list[ArtifactRef]:
        """The model's state dict (with ``ema`` its EMA's weights) stored at ``key`` by rank 0; every rank
        returns the ref."""
        return self._each("export_weights", key, ema)

    def state_digests(self) -> list[str]:
        return self._each("state_digest")

    def device_memory(self) -> list[int]:
        return self._each("device_memory")

    def peak_device_memory(self, reset: bool = False) -> list[int]:
        return self._each("peak_device_memory", reset)

    def node_ids(self) -> list[str]:
        return self._each("node_id")

    def shutdown(self, graceful: bool = True) -> None:
        """End the rank workers, and each rank's process once no group uses it; `graceful`: after they flush
        their system metrics and the last leaves the process group (a group that lost a rank is killed at once,
        with every group sharing its processes: its collectives are broken)."""
        left = [0] * len(self.processes)
        try:
            if graceful:
                left = ray.get([p.remove.remote(self.role) for p in self.processes], timeout=60)
        except Exception as error:  # ending anyway: what matters is that no rank outlives the group
            logger.warning("%s group: a rank did not shut down cleanly (%s); killing the ranks", self.role,
                           type(error).__name__)
            left = [0] * len(self.processes)
        finally:
            for process, others in zip(self.processes, left):
                if not others:
                    ray.kill(process)
            self.processes = []

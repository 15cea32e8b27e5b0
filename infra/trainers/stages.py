"""One DMD2 rollout on trainer groups, as separately callable stages: refs in, refs out.

    rollout -> convert -> critic-train -> score -> actor-train -> sleep

Each stage is one call on one group and is what one Prefect task will run; `run_rollout_on_groups`
chains them exactly as `dmd2.loop.run_rollout` does in process. The driver never holds a tensor.
"""

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from dmd2.config import DistillConfig
from dmd2.family import ModelFamily, RunSpec
from dmd2.hooks import summarize_critic
from infra.trainers.cluster import (RankResources, check_folders_on_every_node, first_bundle_on_each_node,
                                    rank_placement_group, rank_resources)
from infra.trainers.group import TrainerGroup, TrainResult, start_rank_processes
from infra.store import ArtifactRef, ArtifactStore
from infra.tracking.system import SystemMetrics
from infra.trainers.configs import compute_trainer_configs

logger = logging.getLogger(__name__)


@dataclass
class Groups:
    """A run's trainer groups; ``critic`` is None without DMD2."""

    actor: TrainerGroup
    critic: TrainerGroup | None = None
    placement: PlacementGroup | None = None

    def in_order(self) -> list[TrainerGroup]:
        """Training order, as in the trainer config list."""
        return [g for g in (self.critic, self.actor) if g is not None]  # actor is None only mid-build

    def awake_roles(self) -> list[str]:
        """The sleep ledger: the roles of the groups awake now (between stages: none; within one: one)."""
        return [group.role for group in self.in_order() if group.awake()]

    def shutdown(self, graceful: bool = True) -> None:
        """End every rank and free the placement group's resources (`TrainerGroup.shutdown`)."""
        for group in self.in_order():
            group.shutdown(graceful)
        if self.placement is not None:
            remove_placement_group(self.placement)


class StartedRanks:
    """A run's placement group and rank processes, started ahead of its groups (`start_ranks`) so that the ranks'
    start-up (a process; torch, diffusers and the model's code imported) overlaps the driver's own work.
    `build_groups` takes them; until it has, `release` ends them."""

    def __init__(self, placement: PlacementGroup, processes: list | None, resources: RankResources):
        self.placement, self.processes, self.resources = placement, processes, resources
        self._taken = False

    def take(self) -> "StartedRanks":
        self._taken = True
        return self

    def release(self) -> None:
        """`end` them, unless `build_groups` took them (then it, or the groups it made, end them)."""
        if not self._taken:
            self.take().end()

    def end(self) -> None:
        """Kill the processes and free the placement group."""
        for process in self.processes or ():
            ray.kill(process)
        remove_placement_group(self.placement)


def start_ranks(config: DistillConfig, resources: RankResources | None = None, strategy: str | None = None,
                warm: tuple[ModelFamily, str] | None = None) -> StartedRanks:
    """The placement group of the run's groups and, unless the groups' ranks each take GPUs of their own
    (`[cluster] colocate = false`), one `RankProcess` per rank on it. `resources` and `strategy` default to the
    recipe's `[cluster]` (`rank_resources`). Refused before any rank starts if a model folder is missing on a
    node. `warm`: (family, model path) each process imports and builds on the meta device while the caller goes on
    (`RankProcess.warm`)."""
    trainers, world_size = compute_trainer_configs(config, "checkpoints"), config.train.world_size
    resources = resources or rank_resources(config.cluster, len(trainers), world_size)
    placement = rank_placement_group(world_size, resources, groups=len(trainers),
                                     strategy=strategy or config.cluster.placement_strategy)
    try:  # before any rank starts; a hub id is not a folder here: each node fetches it itself
        check_folders_on_every_node(placement, sorted({path for trainer in trainers
                                                       for path in (trainer.init, trainer.teacher)
                                                       if path is not None and os.path.isdir(path)}))
    except BaseException:
        remove_placement_group(placement)
        raise
    processes = None
    if config.cluster.colocate or not resources.num_gpus:
        processes = start_rank_processes(world_size, resources.times(len(trainers)), placement)
        for process in processes if warm else ():
            process.warm.remote(*warm)
    return StartedRanks(placement, processes, resources)


def build_groups(spec: RunSpec, store: ArtifactStore, resources: RankResources | None = None,
                 strategy: str | None = None, checkpoint_dir: str = "checkpoints", num_threads: int = 1,
                 system_metrics: SystemMetrics | None = None, started: StartedRanks | None = None) -> Groups:
    """The groups of the trainer config list: rank i of each on bundle i of one placement group, in one process
    (`RankProcess`) unless the groups' ranks each take GPUs of their own (`[cluster] colocate = false`).

    `started`: the ranks `start_ranks` started for them (else started here, with `resources` and `strategy`). With
    `system_metrics` each node's system metrics go to the run's MLflow run, logged by the first actor rank placed
    there: MLflow's monitor samples the whole node (all its CPUs, every GPU through NVML), so one per rank would log
    each node's figures once per rank, and pay MLflow's import in every rank process."""
    trainers = compute_trainer_configs(spec.config, checkpoint_dir)
    world_size = spec.config.train.world_size
    started = (started or start_ranks(spec.config, resources, strategy)).take()
    placement, processes, resources = started.placement, started.processes, started.resources
    monitors = ({rank: system_metrics.on(node) for rank, node in first_bundle_on_each_node(placement).items()}
                if system_metrics is not None else {})
    made: dict[str, TrainerGroup] = {}
    try:  # every group's ranks start, load their models and join at once: start-up costs the slowest group
        for trainer in trainers:
            made[trainer.role] = TrainerGroup(trainer, spec, store, world_size, resources, placement, num_threads,
                                              monitors if trainer.role == "actor" else {}, wait=False,
                                              processes=processes)
        taken: list[tuple[str, int]] = []
        for group in made.values():
            taken.append(group.join(taken).rendezvous)
        for group in made.values():
            group.wait_ready()
    except BaseException:
        if made:  # the groups own the processes and the placement group
            Groups(actor=made.get("actor"), critic=made.get("critic"), placement=placement).shutdown()
        else:
            started.end()
        raise
    return Groups(actor=made["actor"], critic=made.get("critic"), placement=placement)


def reduce_over_ranks(results: list[TrainResult]) -> list[dict[str, float]]:
    """Per step, the mean of each metric over ranks (the maximum for ``*max*`` diagnostics)."""
    steps = []
    for per_rank in zip(*(r.metrics for r in results)):
        steps.append({key: max(m[key] for m in per_rank) if "max" in key else sum(m[key] for m in per_rank) / len(per_rank)
                      for key in per_rank[0]})
    return steps


# -- the six stages ------------------------------------------------------------------------------

def rollout_stage(groups: Groups, run_id: str, rollout_id: int) -> list[ArtifactRef]:
    """The student's backward-simulated samples, per actor rank."""
    return groups.actor.rollout(run_id, rollout_id)


def convert_stage(groups: Groups, run_id: str, rollout_id: int, samples: list[ArtifactRef]) -> list[ArtifactRef]:
    """Train pairs, per rank (on the actor ranks that hold the samples' shard)."""
    return groups.actor.convert(run_id, rollout_id, samples)


def critic_train_stage(groups: Groups, run_id: str, rollout_id: int,
                       pairs: list[ArtifactRef]) -> tuple[list[ArtifactRef], dict[str, float]]:
    """K critic steps; returns the kept scoring inputs per rank and the critic's metrics row."""
    results = groups.critic.train(run_id, rollout_id, pairs)
    return [r.output for r in results], summarize_critic(reduce_over_ranks(results))


def score_stage(groups: Groups, run_id: str, rollout_id: int, kept: list[ArtifactRef],
                pairs: list[ArtifactRef]) -> list[ArtifactRef]:
    """The teacher's scores of the critic's last-step samples, per critic rank."""
    return groups.critic.score(run_id, rollout_id, kept, pairs)


def actor_train_stage(groups: Groups, run_id: str, rollout_id: int, pairs: list[ArtifactRef],
                      scores: list[ArtifactRef]) -> dict[str, float]:
    """One student step; actor rank i reads critic rank i's scores as ``external_data["critic"]``."""
    results = groups.actor.train(run_id, rollout_id, pairs, external_data={"critic": scores})
    return reduce_over_ranks(results)[0]


def sleep_stage(group: TrainerGroup) -> None:
    """Put a group to sleep after its last use in the rollout (it wakes on its next stage)."""
    group.sleep()


def run_rollout_on_groups(groups: Groups, run_id: str, rollout_id: int) -> dict[str, float]:
    """One DMD2 rollout; returns the actor's metrics and the critic's summary (as `dmd2.loop.run_rollout`)."""
    if groups.critic is None:
        raise ValueError("a DMD2 rollout needs a critic group: build the groups with [train] loss_type = 'dmd2'")
    samples = rollout_stage(groups, run_id, rollout_id)
    sleep_stage(groups.actor)  # the critic's stages come next: the peak is the larger group's, not the sum
    pairs = convert_stage(groups, run_id, rollout_id, samples)
    kept, critic_metrics = critic_train_stage(groups, run_id, rollout_id, pairs)
    scores = score_stage(groups, run_id, rollout_id, kept, pairs)
    sleep_stage(groups.critic)
    actor_metrics = actor_train_stage(groups, run_id, rollout_id, pairs, scores)
    sleep_stage(groups.actor)
    return actor_metrics | critic_metrics


# -- checkpoints of all groups -------------------------------------------------------------------

def save_groups(groups: Groups, run_id: str, step: int) -> ArtifactRef:
    """Checkpoint every group at ``step``; the actor's, written last, links the critic's.

    The actor's checkpoint is at the store's ``checkpoint_key(run_id, step)``, so
    ``store.latest_checkpoint(run_id)`` finds a step whose every group's checkpoint is complete.
    """
    linked = {}
    if groups.critic is not None:
        linked["critic"] = groups.critic.save(run_id, step)[0]
    return groups.actor.save(run_id, step, linked=linked)[0]


def load_groups(groups: Groups, checkpoint: ArtifactRef) -> None:
    """Load the actor's checkpoint ``checkpoint`` and the checkpoints it links into the matching groups."""
    linked = groups.actor.load(checkpoint)[0]
    if groups.critic is not None:
        if "critic" not in linked:
            raise ValueError(f"{checkpoint.uri} links no critic checkpoint; it was saved without DMD2")
        groups.critic.load(linked["critic"])

"""What every rank must agree on for one rollout: the batch layout and the random streams."""

from dataclasses import dataclass

from dmd2.config import DistillConfig
from dmd2.draws import RolloutDraws


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout's layout: B samples per critic step per rank, K critic steps, the student's grid. ``world_size``
    counts the ranks that hold different samples (`[train] world_size / sequence_parallel`)."""

    seed: int
    rollout_id: int
    world_size: int
    critic_steps: int
    batch: int
    sample_shape: tuple[int, ...]
    num_steps: int
    shift: float
    stop_weights: tuple[float, ...] = ()  # backward simulation's odds per stop step; empty: uniform

    @property
    def draws(self) -> RolloutDraws:
        return RolloutDraws(self.seed, self.rollout_id, self.world_size * self.critic_steps * self.batch)


def rollout_plan(config: DistillConfig, rollout_id: int, sample_shape: tuple[int, ...]) -> RolloutPlan:
    """The plan of rollout `rollout_id` of a DMD2 recipe whose samples have shape `sample_shape`."""
    return RolloutPlan(
        seed=config.train.seed,
        rollout_id=rollout_id,
        world_size=config.train.data_ranks,  # the sequence ranks of a group share their samples
        critic_steps=config.dmd2.critic_steps_per_rollout,
        batch=config.critic_batch_size,
        sample_shape=tuple(sample_shape),
        num_steps=config.student.num_steps,
        shift=config.student.grid_shift,
        stop_weights=tuple(config.dmd2.stop_weights),
    )

"""The in-process DMD2 loop: whole rollouts in one process, no orchestration.

rollout -> convert -> K critic steps -> score -> one actor step, with the same stage functions the
Ray trainer groups run. It is the baseline the orchestrated flow is measured against.
"""

import copy
from dataclasses import dataclass
from typing import Callable

from torch import nn

from dmd2.conditioning import CondSource
from dmd2.config import DistillConfig
from dmd2.convert import samples_to_train_pairs
from dmd2.model import DiffusersVelocity, VelocityFn
from dmd2.optim import make_optimizer
from dmd2.stages import (ACTOR_HOOKS, CRITIC_HOOKS, HookContext, RolloutPlan, TrainState, rollout_shard, score,
                         train_steps)


def train_state(model: nn.Module, lr: float, config: DistillConfig) -> TrainState:
    """A model in train mode with AdamW and the warmup schedule of `config.optim`."""
    optim = config.optim
    optimizer, scheduler = make_optimizer(model.parameters(), lr, optim.betas, optim.weight_decay, optim.warmup_steps)
    return TrainState(model.train(), DiffusersVelocity(model), optimizer, scheduler, optim.grad_clip)


def rollout_plan(config: DistillConfig, rollout_id: int, sample_shape: tuple[int, ...]) -> RolloutPlan:
    return RolloutPlan(
        seed=config.train.seed,
        rollout_id=rollout_id,
        world_size=config.train.world_size,
        critic_steps=config.dmd2.critic_steps_per_rollout,
        batch=config.critic_batch_size,
        sample_shape=tuple(sample_shape),
        num_steps=config.student.num_steps,
        shift=config.student.shift,
    )


def summarize_critic(steps: list[dict[str, float]]) -> dict[str, float]:
    """The critic's K steps as one row: mean loss and grad norm, the lr of the last step."""
    return {
        "critic-loss": sum(s["loss"] for s in steps) / len(steps),
        "critic-grad_norm": sum(s["grad_norm"] for s in steps) / len(steps),
        "critic-lr": steps[-1]["lr"],
    }


def run_rollout(
    plan: RolloutPlan, config: DistillConfig, student: TrainState, critic: TrainState,
    teacher: VelocityFn, conds: CondSource,
) -> dict[str, float]:
    """One DMD2 rollout on a single rank (world size 1); returns actor and critic metrics."""
    ctx = HookContext(plan, config.dmd2, rank=0)
    samples = rollout_shard(student.velocity, conds, plan, rank=0)
    pairs = samples_to_train_pairs(samples, plan.num_steps)
    critic_metrics, kept = train_steps(critic, CRITIC_HOOKS, ctx, pairs, plan.critic_steps)
    scores = score(teacher, kept, pairs, ctx)
    actor_ctx = HookContext(plan, config.dmd2, rank=0, external_data={"critic": scores})
    actor_metrics, _ = train_steps(student, ACTOR_HOOKS, actor_ctx, pairs, num_steps=1)
    return actor_metrics[0] | summarize_critic(critic_metrics)


@dataclass
class InProcessDistiller:
    """Student, critic and frozen teacher in this process."""

    config: DistillConfig
    student: TrainState
    critic: TrainState
    teacher: VelocityFn
    conds: CondSource
    sample_shape: tuple[int, ...]

    @classmethod
    def from_models(
        cls, config: DistillConfig, teacher: nn.Module, conds: CondSource, sample_shape: tuple[int, ...],
        student: nn.Module | None = None, critic: nn.Module | None = None,
    ) -> "InProcessDistiller":
        """Student and critic start as copies of the teacher unless given."""
        if config.train.world_size != 1:
            raise ValueError("the in-process loop runs one rank: set [train] world_size = 1 or use the distill flow")
        teacher = teacher.eval().requires_grad_(False)
        student = student if student is not None else copy.deepcopy(teacher).requires_grad_(True)
        critic = critic if critic is not None else copy.deepcopy(teacher).requires_grad_(True)
        return cls(config, train_state(student, config.optim.lr, config), train_state(critic, config.critic_lr, config),
                   DiffusersVelocity(teacher), conds, tuple(sample_shape))

    def run(self, rollouts: range, on_rollout: Callable[[int, dict[str, float]], None] | None = None) -> None:
        for rollout_id in rollouts:
            plan = rollout_plan(self.config, rollout_id, self.sample_shape)
            metrics = run_rollout(plan, self.config, self.student, self.critic, self.teacher, self.conds)
            if on_rollout:
                on_rollout(rollout_id, metrics)

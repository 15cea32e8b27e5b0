"""The in-process DMD2 loop: whole rollouts in one process, no orchestration.

rollout -> convert -> K critic steps -> score -> one actor step, with the same stage functions the
Ray trainer groups run. It is the baseline the orchestrated flow is measured against.
"""

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from torch import nn

from dmd2.conditioning import CondSource
from dmd2.config import DistillConfig
from dmd2.convert import samples_to_train_pairs
from dmd2.gan import GanTap, RealSource, attach_gan_head, tapped
from dmd2.hooks import ACTOR_HOOKS, CRITIC_HOOKS, score, summarize_critic
from dmd2.lora import with_role_adapters
from dmd2.model import DiffusersVelocity, VelocityFn
from dmd2.plan import RolloutPlan, rollout_plan
from dmd2.progress import progress_bar
from dmd2.rollout import rollout_shard
from dmd2.trainer import HookContext, TrainState, train_state, train_steps

if TYPE_CHECKING:
    from dmd2.family import ModelFamily


def run_rollout(
    plan: RolloutPlan, config: DistillConfig, student: TrainState, critic: TrainState,
    teacher: VelocityFn, conds: CondSource, real: RealSource | None = None,
) -> dict[str, float]:
    """One DMD2 rollout on a single rank (world size 1); returns actor and critic metrics. `real`: the GAN's
    real samples (with `[dmd2] critic_gan_weight`; the critic then carries its head, see `from_models`)."""
    ctx = HookContext(plan, config.dmd2, rank=0, real=real)
    samples = rollout_shard(student.velocity, conds, plan, rank=0)
    pairs = samples_to_train_pairs(samples, plan.num_steps)
    critic_metrics, kept = train_steps(critic, CRITIC_HOOKS, ctx, pairs, plan.critic_steps)
    scores = score(teacher, kept, pairs, ctx, critic.velocity)
    actor_ctx = HookContext(plan, config.dmd2, rank=0, external_data={"critic": scores})
    actor_metrics, _ = train_steps(student, ACTOR_HOOKS, actor_ctx, pairs, num_steps=1)
    return actor_metrics[0] | summarize_critic(critic_metrics)


@dataclass
class InProcessDistiller:
    """Student, critic and frozen teacher in this process (`student.ema`: its EMA, with `[student] ema_decay`)."""

    config: DistillConfig
    student: TrainState
    critic: TrainState
    teacher: VelocityFn
    conds: CondSource
    sample_shape: tuple[int, ...]
    real: RealSource | None = None

    @classmethod
    def from_models(
        cls, config: DistillConfig, teacher: nn.Module, conds: CondSource, sample_shape: tuple[int, ...],
        student: nn.Module | None = None, critic: nn.Module | None = None,
        velocity: Callable[[nn.Module], VelocityFn] = DiffusersVelocity, lora_targets: tuple[str, ...] = (),
        real: RealSource | None = None, gan_tap: Callable[[nn.Module], GanTap] | None = None,
    ) -> "InProcessDistiller":
        """Student and critic start as copies of the teacher unless given; `velocity` is the family's call;
        with `[student] lora_rank` they train adapters on the family's `lora_targets` (dmd2/lora.py); with
        `[dmd2] critic_gan_weight` the critic gets a GAN head where the family's `gan_tap` says (dmd2/gan.py),
        trained on `real` samples."""
        if config.train.world_size != 1:
            raise ValueError("the in-process loop runs one rank: set [train] world_size = 1 or use the distill flow")
        teacher = teacher.eval().requires_grad_(False)
        student = student if student is not None else copy.deepcopy(teacher).requires_grad_(True)
        critic = critic if critic is not None else copy.deepcopy(teacher).requires_grad_(True)
        student = with_role_adapters(student, config, "actor", lora_targets)
        critic = with_role_adapters(critic, config, "critic", lora_targets)
        if config.dmd2.critic_gan_weight > 0:
            if real is None or gan_tap is None:
                raise ValueError("[dmd2] critic_gan_weight > 0: pass the family's real samples and gan_tap")
            critic = attach_gan_head(critic, gan_tap(critic), config.train.seed)
        return cls(config, train_state(student, config.optim.lr, config, velocity, config.student.ema_decay),
                   train_state(critic, config.critic_lr, config, lambda model: tapped(velocity(model), model),
                               steps_per_rollout=config.dmd2.critic_steps_per_rollout),
                   velocity(teacher), conds, tuple(sample_shape), real)

    @classmethod
    def for_family(cls, config: DistillConfig, family: "ModelFamily", cache_dir: Path, teacher: nn.Module | None = None,
                   student: nn.Module | None = None, critic: nn.Module | None = None) -> "InProcessDistiller":
        """The loop of `family`'s run of `config` (resolved; `family` bound to its prepared inputs if it has any),
        built as its ranks build theirs: the family's sample shape, conditioning, velocity and LoRA targets, and
        with `[dmd2] critic_gan_weight` its GAN head and real samples. `teacher`: default, the family loads it."""
        spec = family.run_spec(config, cache_dir)
        teacher = family.load_model(config.model.teacher) if teacher is None else teacher
        gan = config.dmd2.critic_gan_weight > 0
        return cls.from_models(config, teacher, spec.conds, spec.sample_shape, student, critic, family.velocity,
                               family.lora_targets, family.real_source(spec) if gan else None,
                               family.gan_tap if gan else None)

    def run(self, rollouts: range, on_rollout: Callable[[int, dict[str, float]], None] | None = None) -> None:
        for rollout_id in rollouts:
            plan = rollout_plan(self.config, rollout_id, self.sample_shape)
            metrics = run_rollout(plan, self.config, self.student, self.critic, self.teacher, self.conds, self.real)
            if on_rollout:
                on_rollout(rollout_id, metrics)

    def distilled(self, name: str) -> nn.Module:
        """The recipe's `[train] rollouts` run with a progress bar named ``name``; the student as a run evaluates
        and exports it (with `[student] ema_decay`: its EMA's weights)."""
        with progress_bar(self.config.train.rollouts, name, unit="rollout") as bar:
            self.run(range(self.config.train.rollouts), lambda rollout_id, metrics: bar.update(1))
        if self.student.ema is not None:
            with self.student.ema.applied():
                return copy.deepcopy(self.student.model).eval()
        return self.student.model.eval()

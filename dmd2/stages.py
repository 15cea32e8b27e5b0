"""One rollout's stages on one rank: rollout -> convert -> critic-train -> score -> actor-train.

Plain functions over models and optimizers, called by the in-process loop (`dmd2.loop`) and by the Ray
rank actors alike, so both compute the same thing. All randomness comes from `RolloutDraws`, keyed by
global sample index, so the result does not depend on the world size.
"""

from dataclasses import dataclass

import torch
from torch import nn

from dmd2.actor import actor_loss
from dmd2.conditioning import CondSource
from dmd2.config import DMD2Config
from dmd2.convert import TrainPairs
from dmd2.critic import ScoringInputs, critic_loss
from dmd2.draws import RolloutDraws, shard_rows
from dmd2.model import VelocityFn
from dmd2.optim import optimizer_step
from dmd2.rollout import RolloutSamples, backward_simulate
from dmd2.schedule import student_sigmas
from dmd2.scoring import Scores, score_with_teacher, separate_critic_draw
from dmd2.tensors import select_rows


@dataclass(frozen=True)
class RolloutPlan:
    """What every rank must agree on for one rollout: B samples per critic step per rank, K steps."""

    seed: int
    rollout_id: int
    world_size: int
    critic_steps: int
    batch: int
    sample_shape: tuple[int, ...]
    num_steps: int
    shift: float

    @property
    def draws(self) -> RolloutDraws:
        return RolloutDraws(self.seed, self.rollout_id, self.world_size * self.critic_steps * self.batch)


@dataclass
class TrainState:
    """A trained model with its optimizer and lr schedule; `velocity` is how the algorithm calls it."""

    model: nn.Module
    velocity: VelocityFn
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float


def rollout_shard(student: VelocityFn, conds: CondSource, plan: RolloutPlan, rank: int) -> RolloutSamples:
    """Backward-simulated student samples for this rank's K*B rows of the global batch."""
    draws, rows = plan.draws, shard_rows(rank, plan.world_size, plan.critic_steps, plan.batch)
    stop_index = draws.integers("stop", plan.num_steps, rows)
    noise = draws.normal("noise", rows, plan.sample_shape)
    renoise = torch.stack([draws.normal(f"renoise/{j}", rows, plan.sample_shape) for j in range(plan.num_steps - 1)]) \
        if plan.num_steps > 1 else noise.new_empty((0, *noise.shape))
    cond, neg_cond = conds(draws, rows)
    x_i, x0_hat, sigma = backward_simulate(
        student, noise, student_sigmas(plan.num_steps, plan.shift), stop_index, cond, renoise
    )
    return RolloutSamples(x_i, x0_hat, sigma, stop_index, cond, neg_cond, rows)


def critic_step_pairs(pairs: TrainPairs, plan: RolloutPlan, step: int) -> TrainPairs:
    """Step j trains on local rows [j*B, (j+1)*B); the last step's rows are the ones the actor trains on."""
    return select_rows(pairs, slice(step * plan.batch, (step + 1) * plan.batch))


def train_critic(
    critic: TrainState, pairs: TrainPairs, plan: RolloutPlan, dmd2: DMD2Config
) -> tuple[list[dict[str, float]], ScoringInputs]:
    """K critic steps; returns each step's metrics and the last step's scoring inputs."""
    draws, metrics, kept = plan.draws, [], None
    for step in range(plan.critic_steps):
        batch = critic_step_pairs(pairs, plan, step)
        last = step == plan.critic_steps - 1
        if last and dmd2.critic_scoring == "original":
            kept = separate_critic_draw(
                critic.velocity, batch.x0, batch.cond, batch.sample_index,
                draws.normal("score/noise", batch.sample_index, plan.sample_shape),
                draws.uniform("score/sigma", batch.sample_index),
                shift=dmd2.sigma_shift, score_sigma_range=dmd2.score_sigma_range,
            )
        fused = last and dmd2.critic_scoring == "fused"
        loss, fused_kept = critic_loss(
            critic.velocity, batch.x0, batch.cond, batch.sample_index,
            draws.normal("critic/noise", batch.sample_index, plan.sample_shape),
            draws.uniform("critic/sigma", batch.sample_index),
            shift=dmd2.sigma_shift, loss_space=dmd2.critic_loss_space,
            score_sigma_range=dmd2.score_sigma_range if fused else None,
        )
        kept = fused_kept if fused else kept
        metrics.append(optimizer_step(critic.model, critic.optimizer, critic.scheduler, loss, critic.grad_clip))
    return metrics, kept


def score(teacher: VelocityFn, kept: ScoringInputs, pairs: TrainPairs, plan: RolloutPlan, dmd2: DMD2Config) -> Scores:
    """The teacher's guided x0_real at the kept x_s of the last critic step's samples."""
    batch = critic_step_pairs(pairs, plan, plan.critic_steps - 1)
    return score_with_teacher(teacher, kept, batch.cond, batch.neg_cond, dmd2.teacher_guidance_scale)


def train_actor(student: TrainState, pairs: TrainPairs, scores: Scores, plan: RolloutPlan) -> dict[str, float]:
    """One generator step on the scored samples (the last B of this rank's shard)."""
    batch = critic_step_pairs(pairs, plan, plan.critic_steps - 1)
    loss, diagnostics = actor_loss(student.velocity, batch, scores)
    return optimizer_step(student.model, student.optimizer, student.scheduler, loss, student.grad_clip) | diagnostics

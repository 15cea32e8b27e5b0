"""One rollout's stages on one rank, written as a generic trainer plus DMD2's hooks.

`train_steps` is the trainer every group runs (in-process loop and Ray rank actors alike); what makes
a group a DMD2 critic or a DMD2 actor is its hooks:

    train_input(ctx, pairs) -> pairs                      reshape a group's pairs before batching
    prepare(ctx, pairs, step) -> batch                    the pairs of optimizer step `step`
    loss(ctx, model, batch, step) -> (loss, metrics, keep)  one step's loss; `keep` feeds train_output
    train_output(ctx, kept) -> output                     no grad, after the steps; the group's output

`ctx` is rollout-level and read-only (`HookContext`); what changes per step (the step index, what a
loss keeps) travels as arguments and return values. All randomness comes from `RolloutDraws`, keyed
by global sample index, so results do not depend on the world size.
"""

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

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


@dataclass(frozen=True)
class HookContext:
    """Rollout-level, read-only context of a group's hooks on one rank."""

    plan: RolloutPlan
    dmd2: DMD2Config
    rank: int
    external_data: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainState:
    """A trained model with its optimizer and lr schedule; `velocity` is how the algorithm calls it."""

    model: nn.Module
    velocity: VelocityFn
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float


@dataclass(frozen=True)
class Hooks:
    """A group's four hooks (see the module docstring for their signatures)."""

    loss: Callable[[HookContext, VelocityFn, TrainPairs, int], tuple[Tensor, dict[str, float], Any]]
    prepare: Callable[[HookContext, TrainPairs, int], TrainPairs]
    train_input: Callable[[HookContext, TrainPairs], TrainPairs] = lambda ctx, pairs: pairs
    train_output: Callable[[HookContext, list[Any]], Any] = lambda ctx, kept: None


def train_steps(
    state: TrainState, hooks: Hooks, ctx: HookContext, pairs: TrainPairs, num_steps: int
) -> tuple[list[dict[str, float]], Any]:
    """The generic trainer: `num_steps` optimizer steps, then the train-output hook without grad."""
    pairs = hooks.train_input(ctx, pairs)
    metrics, kept = [], []
    for step in range(num_steps):
        loss, step_metrics, keep = hooks.loss(ctx, state.velocity, hooks.prepare(ctx, pairs, step), step)
        metrics.append(optimizer_step(state.model, state.optimizer, state.scheduler, loss, state.grad_clip) | step_metrics)
        kept.append(keep)
    with torch.no_grad():
        return metrics, hooks.train_output(ctx, kept)


def rollout_shard(student: VelocityFn, conds: CondSource, plan: RolloutPlan, rank: int) -> RolloutSamples:
    """Backward-simulated student samples for this rank's K*B rows of the global batch."""
    draws, rows = plan.draws, shard_rows(rank, plan.world_size, plan.critic_steps, plan.batch)
    stop_index = draws.integers("stop", plan.num_steps, rows)
    noise = draws.normal("noise", rows, plan.sample_shape)
    renoise = [draws.normal(f"renoise/{j}", rows, plan.sample_shape) for j in range(plan.num_steps - 1)]
    renoise = torch.stack(renoise) if renoise else noise.new_empty((0, *noise.shape))
    cond, neg_cond = conds(draws, rows)
    sigmas = student_sigmas(plan.num_steps, plan.shift)
    x_i, x0_hat, sigma = backward_simulate(student, noise, sigmas, stop_index, cond, renoise)
    return RolloutSamples(x_i, x0_hat, sigma, stop_index, cond, neg_cond, rows)


def critic_step_pairs(ctx: HookContext, pairs: TrainPairs, step: int) -> TrainPairs:
    """Step j trains on local rows [j*B, (j+1)*B); the last step's rows are the ones the actor trains on."""
    batch = ctx.plan.batch
    return select_rows(pairs, slice(step * batch, (step + 1) * batch))


def scored_pairs(ctx: HookContext, pairs: TrainPairs, step: int = 0) -> TrainPairs:
    """The actor's batch: the critic's last step's samples, the only ones that were scored."""
    return critic_step_pairs(ctx, pairs, ctx.plan.critic_steps - 1)


def critic_loss_hook(
    ctx: HookContext, critic: VelocityFn, batch: TrainPairs, step: int
) -> tuple[Tensor, dict[str, float], ScoringInputs | None]:
    """The critic's flow-matching loss; the last step also keeps the scoring inputs (fused or original)."""
    plan, dmd2, draws = ctx.plan, ctx.dmd2, ctx.plan.draws
    last = step == plan.critic_steps - 1
    kept = None
    if last and dmd2.critic_scoring == "original":  # before this step's update, with its own draw
        kept = separate_critic_draw(
            critic, batch.x0, batch.cond, batch.sample_index,
            draws.normal("score/noise", batch.sample_index, plan.sample_shape),
            draws.uniform("score/sigma", batch.sample_index),
            shift=dmd2.sigma_shift, score_sigma_range=dmd2.score_sigma_range,
        )
    fused = last and dmd2.critic_scoring == "fused"
    loss, fused_kept = critic_loss(
        critic, batch.x0, batch.cond, batch.sample_index,
        draws.normal("critic/noise", batch.sample_index, plan.sample_shape),
        draws.uniform("critic/sigma", batch.sample_index),
        shift=dmd2.sigma_shift, loss_space=dmd2.critic_loss_space,
        score_sigma_range=dmd2.score_sigma_range if fused else None,
    )
    return loss, {}, fused_kept if fused else kept


def last_kept(ctx: HookContext, kept: list[Any]) -> ScoringInputs:
    """The critic group's output: what its last step kept for scoring."""
    return kept[-1]


def actor_loss_hook(
    ctx: HookContext, student: VelocityFn, batch: TrainPairs, step: int
) -> tuple[Tensor, dict[str, float], None]:
    """The DMD loss against the paired critic rank's scores (`ctx.external_data["critic"]`)."""
    loss, diagnostics = actor_loss(student, batch, ctx.external_data["critic"])
    return loss, diagnostics, None


CRITIC_HOOKS = Hooks(loss=critic_loss_hook, prepare=critic_step_pairs, train_output=last_kept)
ACTOR_HOOKS = Hooks(loss=actor_loss_hook, prepare=scored_pairs)


def score(teacher: VelocityFn, kept: ScoringInputs, pairs: TrainPairs, ctx: HookContext) -> Scores:
    """The teacher's guided x0_real at the kept x_s of the last critic step's samples."""
    batch = scored_pairs(ctx, pairs)
    return score_with_teacher(teacher, kept, batch.cond, batch.neg_cond, ctx.dmd2.teacher_guidance_scale)

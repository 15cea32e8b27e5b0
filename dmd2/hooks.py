"""DMD2 on the generic trainer (`dmd2.trainer`): the critic's and the actor's hooks, and teacher scoring.

The critic trains K steps on the rollout's pairs, step j on local rows [j*B, (j+1)*B), and its last
step keeps what scoring needs; the teacher scores those samples; the actor trains one step on exactly
them, against the paired critic rank's scores (`external_data["critic"]`). Every random number comes
from the plan's `RolloutDraws`, keyed by global sample index, so results do not depend on world size.
"""

from typing import Any

from torch import Tensor

from dmd2.actor import actor_loss
from dmd2.convert import TrainPairs
from dmd2.critic import ScoringInputs, critic_loss
from dmd2.model import VelocityFn
from dmd2.scoring import Scores, score_with_teacher, separate_critic_draw
from dmd2.tensors import select_rows
from dmd2.trainer import HookContext, Hooks


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
    device = batch.x0.device
    last = step == plan.critic_steps - 1
    kept = None
    if last and dmd2.critic_scoring == "original":  # before this step's update, with its own draw
        kept = separate_critic_draw(
            critic, batch.x0, batch.cond, batch.sample_index,
            draws.normal("score/noise", batch.sample_index, plan.sample_shape, device),
            draws.uniform("score/sigma", batch.sample_index, device),
            shift=dmd2.critic_shift, score_sigma_range=dmd2.score_sigma_range, sampling=dmd2.critic_sigma_sampling,
        )
    fused = last and dmd2.critic_scoring == "fused"
    loss, fused_kept = critic_loss(
        critic, batch.x0, batch.cond, batch.sample_index,
        draws.normal("critic/noise", batch.sample_index, plan.sample_shape, device),
        draws.uniform("critic/sigma", batch.sample_index, device),
        shift=dmd2.critic_shift, loss_space=dmd2.critic_loss_space,
        score_sigma_range=dmd2.score_sigma_range if fused else None, sampling=dmd2.critic_sigma_sampling,
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


def summarize_critic(steps: list[dict[str, float]]) -> dict[str, float]:
    """The critic's K steps as one row: mean loss and grad norm, the lr of the last step."""
    return {
        "critic-loss": sum(s["loss"] for s in steps) / len(steps),
        "critic-grad_norm": sum(s["grad_norm"] for s in steps) / len(steps),
        "critic-lr": steps[-1]["lr"],
    }

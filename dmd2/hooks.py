"""DMD2 on the generic trainer (`dmd2.trainer`): the critic's and the actor's hooks, and teacher scoring.

The critic trains K steps on the rollout's pairs, step j on local rows [j*B, (j+1)*B), and its last
step keeps what scoring needs; the teacher scores those samples; the actor trains one step on exactly
them, against the paired critic rank's scores (`external_data["critic"]`). Every random number comes
from the plan's `RolloutDraws`, keyed by global sample index, so results do not depend on world size.
"""

import dataclasses
from typing import Any

from torch import Tensor

from dmd2.actor import actor_loss
from dmd2.convert import TrainPairs
from dmd2.critic import ScoringInputs, critic_loss
from dmd2.guard import sample_signals
from dmd2.gan import TappedCritic, WithRealRows, discriminator_loss, generator_gradient, noised_real
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
) -> tuple[Tensor, dict[str, Tensor], ScoringInputs | None]:
    """The critic's flow-matching loss, plus `critic_gan_weight` L_D (`dmd2.gan`) from the same forward with noised
    real rows appended; the last step also keeps the scoring inputs (fused or original)."""
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
    model = critic
    if dmd2.critic_gan_weight > 0:  # real samples drawn in the sigma range this step's fakes are drawn in
        model = WithRealRows(_tapped(critic), *noised_real(
            _real(ctx), draws, batch.sample_index, plan.sample_shape, device, shift=dmd2.critic_shift,
            sigma_range=dmd2.score_sigma_range if fused else (0.0, 1.0), sampling=dmd2.critic_sigma_sampling))
    loss, fused_kept = critic_loss(
        model, batch.x0, batch.cond, batch.sample_index,
        draws.normal("critic/noise", batch.sample_index, plan.sample_shape, device),
        draws.uniform("critic/sigma", batch.sample_index, device),
        shift=dmd2.critic_shift, loss_space=dmd2.critic_loss_space,
        score_sigma_range=dmd2.score_sigma_range if fused else None, sampling=dmd2.critic_sigma_sampling,
    )
    metrics = {}
    if dmd2.critic_gan_weight > 0:
        d_loss, metrics = discriminator_loss(model.logits_real, model.logits_fake)
        loss = loss + dmd2.critic_gan_weight * d_loss
    return loss, metrics, fused_kept if fused else kept


def _tapped(critic: VelocityFn) -> TappedCritic:
    if not isinstance(critic, TappedCritic):
        raise TypeError("[dmd2] critic_gan_weight > 0 needs a critic with a GAN head, called as a "
                        "dmd2.gan.TappedCritic (attach_gan_head, then tapped)")
    return critic


def _real(ctx: HookContext):
    if ctx.real is None:
        raise ValueError("[dmd2] critic_gan_weight > 0 needs real samples, and this run's family supplies none "
                         "(its real_source): set critic_gan_weight = 0")
    return ctx.real


def last_kept(ctx: HookContext, kept: list[Any]) -> ScoringInputs:
    """The critic group's output: what its last step kept for scoring."""
    return kept[-1]


def actor_loss_hook(
    ctx: HookContext, student: VelocityFn, batch: TrainPairs, step: int
) -> tuple[Tensor, dict[str, Tensor], None]:
    """The DMD loss against the paired critic rank's scores (`ctx.external_data["critic"]`)."""
    loss, diagnostics = actor_loss(student, batch, ctx.external_data["critic"], ctx.dmd2.gan_weight)
    return loss, diagnostics | sample_signals(batch.x0), None  # the rollout's samples, for the collapse guard


CRITIC_HOOKS = Hooks(loss=critic_loss_hook, prepare=critic_step_pairs, train_output=last_kept)
ACTOR_HOOKS = Hooks(loss=actor_loss_hook, prepare=scored_pairs)


def score(teacher: VelocityFn, kept: ScoringInputs, pairs: TrainPairs, ctx: HookContext,
          critic: VelocityFn | None = None) -> Scores:
    """The teacher's guided x0_real at the kept x_s of the last critic step's samples; with `[dmd2] gan_weight`,
    also the generator's GAN gradient through the critic (a `TappedCritic`, unwrapped: no DDP reduction)."""
    batch = scored_pairs(ctx, pairs)
    scores = score_with_teacher(teacher, kept, batch.cond, batch.neg_cond, ctx.dmd2.teacher_guidance_scale)
    if ctx.dmd2.gan_weight > 0:
        gan_grad, gan_logit = generator_gradient(_tapped(critic), kept.x_s, kept.sigma, batch.cond)
        scores = dataclasses.replace(scores, gan_grad=gan_grad, gan_logit=gan_logit)
    return scores


def summarize_critic(steps: list[dict[str, float]]) -> dict[str, float]:
    """The critic's K steps as one row: mean loss, grad norm and GAN figures, the lr of the last step."""
    means = ["loss", "grad_norm"] + sorted(key for key in steps[0] if key.startswith("gan_"))
    return {f"critic-{key}": sum(s[key] for s in steps) / len(steps) for key in means} | {"critic-lr": steps[-1]["lr"]}

"""Scoring the student's samples with the frozen teacher (real score) and the critic (fake score).

Step 4 of docs/architecture.md §1. `fused` (default) reuses the critic's last training forward for x0_fake, see
`dmd2.critic.critic_loss`; `original` (tianweiy/DMD2's order) draws its own sigma and noise and runs a
separate critic forward before the critic's last step.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.critic import ScoringInputs, training_sigma
from dmd2.model import Cond, VelocityFn, guided
from dmd2.schedule import add_noise, x0_from_velocity


@dataclass(frozen=True)
class Scores:
    """Real and fake x0 predictions at the kept x_s, keyed by sample_index [B]; sigma [B] is the score sigma.

    With the GAN (`[dmd2] gan_weight`): gan_grad [B, ...], the generator's d softplus(-D(x_s)) / d x0_hat per
    sample, and gan_logit [B], the head's logits at x_s (`dmd2.gan.generator_gradient`); else None.
    """

    sample_index: Tensor
    sigma: Tensor
    x0_real: Tensor
    x0_fake: Tensor
    gan_grad: Tensor | None = None
    gan_logit: Tensor | None = None


@torch.no_grad()
def score_with_teacher(
    teacher: VelocityFn, kept: ScoringInputs, cond: Cond, neg_cond: Cond, guidance_scale: float
) -> Scores:
    """x0_real = x_s - sigma * v_teacher, with CFG `guidance_scale` over `neg_cond`, at the kept x_s."""
    v_real = guided(teacher, guidance_scale, neg_cond)(kept.x_s, kept.sigma, cond)
    x0_real = x0_from_velocity(kept.x_s, kept.sigma, v_real)
    return Scores(kept.sample_index, kept.sigma, x0_real, kept.x0_fake)


@torch.no_grad()
def separate_critic_draw(
    critic: VelocityFn,
    x0_hat: Tensor,
    cond: Cond,
    sample_index: Tensor,
    eps: Tensor,
    u: Tensor,
    *,
    shift: float,
    score_sigma_range: tuple[float, float],
    sampling: str = "uniform",
) -> ScoringInputs:
    """`original` scoring: a fresh sigma in the range and fresh noise, and a separate no-grad critic forward."""
    sigma = training_sigma(u, shift, score_sigma_range, sampling)
    x_s = add_noise(x0_hat, eps, sigma)
    x0_fake = x0_from_velocity(x_s, sigma, critic(x_s, sigma, cond))
    return ScoringInputs(x_s, sigma, x0_fake, sample_index)

"""The fake-score critic's flow-matching step (docs/architecture.md §1 step 3; DMD2 "guidance" / fake score update).

The critic learns the student's current distribution: the flow-matching loss of the teacher's own
training, on the detached student sample x0_hat with fresh noise. The last of the K steps per rollout
also keeps what scoring needs, from the same forward (fused scoring), i.e. before that step's update.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.config import LOSS_SPACES, SIGMA_SAMPLINGS
from dmd2.model import Cond, VelocityFn
from dmd2.schedule import add_noise, shift_sigma, velocity_target, x0_from_velocity


@dataclass(frozen=True)
class ScoringInputs:
    """Kept by the critic for scoring: x_s [B, ...], sigma [B], x0_fake [B, ...] (detached), sample_index [B]."""

    x_s: Tensor
    sigma: Tensor
    x0_fake: Tensor
    sample_index: Tensor


def training_sigma(u: Tensor, shift: float, sigma_range: tuple[float, float] = (0.0, 1.0),
                   sampling: str = "uniform") -> Tensor:
    """Map uniform draws u [B] to training sigmas inside `sigma_range`, then the time shift.

    `uniform`: sigma = low + (high - low) u. `logit_normal` (Esser et al. 2024, eq. 19, m = 0, s = 1):
    sigma = sigmoid(n) with n ~ N(0, 1), drawn by inverse CDF from u restricted to the range, i.e.
    sigma = sigmoid(Phi^-1(Phi(logit low) + (Phi(logit high) - Phi(logit low)) u)).
    The range bounds the unshifted sigma (FastGen's min_t..max_t convention), so a scoring range of
    (0.02, 0.98) means the same noise levels whatever the shift.
    """
    low, high = sigma_range
    if sampling == "uniform":
        unshifted = low + (high - low) * u
    elif sampling == "logit_normal":
        bounds = torch.special.ndtr(torch.logit(torch.tensor([low, high], dtype=torch.float64)))
        p = bounds[0] + (bounds[1] - bounds[0]) * u.double()
        unshifted = torch.sigmoid(torch.special.ndtri(p)).to(u.dtype)
    else:
        raise ValueError(f"sigma sampling must be one of {SIGMA_SAMPLINGS}, got {sampling!r}")
    return shift_sigma(unshifted, shift)


def flow_matching_loss(
    model: VelocityFn, x0: Tensor, cond: Cond, sigma: Tensor, eps: Tensor, loss_space: str = "velocity"
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample flow-matching loss (Lipman et al. 2023; Esser et al. 2024 eq. 3).

    x_s = (1 - sigma) x0 + sigma eps, v = model(x_s, sigma, cond);
    velocity space: mean_{CHW} (v - (eps - x0))^2; x0 space: mean_{CHW} (x_s - sigma v - x0)^2, which is
    sigma^2 times the velocity loss. Returns (loss [B], x_s [B, ...], v [B, ...]).
    """
    x_s = add_noise(x0, eps, sigma)
    v = model(x_s, sigma, cond)
    if loss_space == "velocity":
        error = v.float() - velocity_target(x0, eps).float()
    elif loss_space == "x0":
        error = x0_from_velocity(x_s, sigma, v).float() - x0.float()
    else:
        raise ValueError(f"loss space must be one of {LOSS_SPACES}, got {loss_space!r}")
    return error.pow(2).flatten(1).mean(1), x_s, v


def critic_loss(
    critic: VelocityFn,
    x0_hat: Tensor,
    cond: Cond,
    sample_index: Tensor,
    eps: Tensor,
    u: Tensor,
    *,
    shift: float,
    loss_space: str,
    score_sigma_range: tuple[float, float] | None,
    sampling: str = "uniform",
) -> tuple[Tensor, ScoringInputs | None]:
    """One critic step's loss on the student's detached x0_hat; keeps scoring inputs on the last step.

    Pass `score_sigma_range` on the step that scores (the last of K, fused scoring): sigma is then drawn
    inside that range and (x_s, sigma, x0_fake = x_s - sigma v_fake) are returned, detached, from this
    very forward — the critic as it was before the step that trains on these samples.
    Returns (scalar loss, ScoringInputs or None).
    """
    keeps = score_sigma_range is not None
    sigma = training_sigma(u, shift, score_sigma_range if keeps else (0.0, 1.0), sampling)
    per_sample, x_s, v = flow_matching_loss(critic, x0_hat.detach(), cond, sigma, eps, loss_space)
    kept = None
    if keeps:
        with torch.no_grad():
            kept = ScoringInputs(x_s.detach(), sigma, x0_from_velocity(x_s, sigma, v).detach(), sample_index)
    return per_sample.mean(), kept

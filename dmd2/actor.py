"""The student's (actor's) distribution-matching step (docs/architecture.md §1 step 5; DMD2, Yin et al. 2024, eq. 2).

The KL gradient between the student's and the teacher's diffused distributions is estimated by the
difference of the fake and real scores; tianweiy/DMD2 (`compute_distribution_matching_loss`) writes it
in x0 space and normalises it per sample:
    g = (x0_fake - x0_real) / mean_{C,H,W} |x0_hat - x0_real|
    loss = 0.5 * mse(x0_hat, stopgrad(x0_hat - g))       so that d loss / d x0_hat = g / numel.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from dmd2.convert import TrainPairs
from dmd2.model import VelocityFn
from dmd2.schedule import x0_from_velocity
from dmd2.scoring import Scores


def dmd_gradient(x0_hat: Tensor, x0_real: Tensor, x0_fake: Tensor) -> tuple[Tensor, Tensor]:
    """g [B, ...] and the per-sample normaliser [B] (all detached; NaN/inf from a zero normaliser -> 0)."""
    with torch.no_grad():
        x0_hat, x0_real, x0_fake = x0_hat.float(), x0_real.float(), x0_fake.float()
        normaliser = (x0_hat - x0_real).abs().flatten(1).mean(1)
        shape = (-1,) + (1,) * (x0_hat.dim() - 1)
        g = torch.nan_to_num((x0_fake - x0_real) / normaliser.reshape(shape))
    return g, normaliser


def align_scores(pairs: TrainPairs, scores: Scores) -> Scores:
    """Scores reordered to the pairs' sample order; every pair must have exactly one score."""
    order = {int(index): row for row, index in enumerate(scores.sample_index)}
    missing = [int(i) for i in pairs.sample_index if int(i) not in order]
    if missing or len(order) != len(pairs):
        raise ValueError(
            f"the critic's scores do not cover the actor's samples: missing {missing[:5]}, "
            f"{len(order)} scores for {len(pairs)} samples; the actor trains on exactly the critic's last step"
        )
    rows = torch.tensor([order[int(i)] for i in pairs.sample_index])
    return Scores(pairs.sample_index, scores.sigma[rows], scores.x0_real[rows], scores.x0_fake[rows])


def actor_loss(student: VelocityFn, pairs: TrainPairs, scores: Scores) -> tuple[Tensor, dict[str, float]]:
    """DMD loss on the scored samples; recomputes x0_hat = x_i - sigma_i G(x_i, sigma_i, cond) with grad.

    Returns (scalar loss, diagnostics): the mean |g|, the mean normaliser, and the max |x0_hat - rollout
    x0_hat| (zero up to numerics while the weights are the rollout's: a larger value means the actor
    trains on a different model or batch than it rolled out).
    """
    scores = align_scores(pairs, scores)
    x0_hat = x0_from_velocity(pairs.latent, pairs.sigma, student(pairs.latent, pairs.sigma, pairs.cond))
    g, normaliser = dmd_gradient(x0_hat, scores.x0_real, scores.x0_fake)
    loss = 0.5 * F.mse_loss(x0_hat.float(), (x0_hat.float() - g).detach())
    metrics = {
        "dmd_grad_abs": g.abs().mean().item(),
        "dmd_normaliser": normaliser.mean().item(),
        "x0_recompute_max_diff": (x0_hat.detach() - pairs.x0).abs().max().item(),
        "score_sigma": scores.sigma.mean().item(),
    }
    return loss, metrics

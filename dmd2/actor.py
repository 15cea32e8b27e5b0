"""The student's (actor's) distribution-matching step (docs/architecture.md §1 step 5; DMD2, Yin et al. 2024, eq. 2).

The KL gradient between the student's and the teacher's diffused distributions is estimated by the
difference of the fake and real scores; tianweiy/DMD2 (`compute_distribution_matching_loss`) writes it
in x0 space and normalises it per sample:
    g = (x0_fake - x0_real) / mean_{C,H,W} |x0_hat - x0_real|
    loss = 0.5 * mse(x0_hat, stopgrad(x0_hat - g))       so that d loss / d x0_hat = g / numel.
With the GAN (`[dmd2] gan_weight` w), plus w L_G through the critic side's gradient (`dmd2.gan.generator_surrogate`).
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from dmd2.convert import TrainPairs
from dmd2.gan import generator_surrogate
from dmd2.model import VelocityFn
from dmd2.schedule import x0_from_velocity
from dmd2.scoring import Scores
from dmd2.tensors import on_host, select_rows


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
    with on_host():  # sample indices are host data
        scored, wanted = scores.sample_index.tolist(), pairs.sample_index.tolist()
    order = {index: row for row, index in enumerate(scored)}
    missing = [i for i in wanted if i not in order]
    if missing or len(order) != len(pairs):
        raise ValueError(
            f"the critic's scores do not cover the actor's samples: missing {missing[:5]}, "
            f"{len(order)} scores for {len(pairs)} samples; the actor trains on exactly the critic's last step"
        )
    with on_host():
        rows = torch.tensor([order[i] for i in wanted])
    return dataclasses.replace(select_rows(scores, rows), sample_index=pairs.sample_index)


def actor_loss(student: VelocityFn, pairs: TrainPairs, scores: Scores,
               gan_weight: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DMD loss on the scored samples, plus `gan_weight` L_G when > 0 (the scores then carry the critic side's
    gan_grad); recomputes x0_hat = x_i - sigma_i G(x_i, sigma_i, cond) with grad.

    Returns (scalar loss, diagnostics): the mean |g|, the mean normaliser, the max |x0_hat - rollout
    x0_hat| (zero up to numerics while the weights are the rollout's: a larger value means the actor
    trains on a different model or batch than it rolled out), and with the GAN, L_G as `gan_g_loss`.
    """
    scores = align_scores(pairs, scores)
    x0_hat = x0_from_velocity(pairs.latent, pairs.sigma, student(pairs.latent, pairs.sigma, pairs.cond))
    g, normaliser = dmd_gradient(x0_hat, scores.x0_real, scores.x0_fake)
    loss = 0.5 * F.mse_loss(x0_hat.float(), (x0_hat.float() - g).detach())
    metrics = {  # read once the step is issued (`dmd2.trainer.train_steps`): no wait for the host in between
        "dmd_grad_abs": g.abs().mean(),
        "dmd_normaliser": normaliser.mean(),
        "x0_recompute_max_diff": (x0_hat.detach() - pairs.x0).abs().max(),
        "score_sigma": scores.sigma.mean(),
    }
    if gan_weight > 0:
        if scores.gan_grad is None:
            raise ValueError("[dmd2] gan_weight > 0, but the critic's scores carry no GAN gradient: the critic "
                             "group scores without gan_weight (a different recipe?)")
        g_loss = generator_surrogate(x0_hat, scores.gan_grad, scores.gan_logit)
        loss = loss + gan_weight * g_loss
        metrics["gan_g_loss"] = g_loss.detach()
    return loss, metrics

"""Flow-matching schedule: sigma grids, timesteps, noising, x0/velocity conversions and CFG.

Conventions (rectified flow, as in SD3 / Flux / Wan; docs/architecture.md §1):
    x_s = (1 - sigma) * x0 + sigma * eps          (noising, sigma in [0, 1])
    v   = eps - x0                                 (the model's velocity target)
    x0  = x_s - sigma * v                          (x0 recovered from a velocity)
    t   = 1000 * sigma                             (the model's timestep, after any shift)
"""

import torch
from torch import Tensor

from dmd2.conventions import TIMESTEP_SCALE


def shift_sigma(sigma: Tensor, shift: float) -> Tensor:
    """Time shift of SD3 (Esser et al. 2024, eq. 23): sigma' = shift * s / (1 + (shift - 1) * s).

    shift > 1 spends more of a grid (or of training) at high noise; shift = 1 is the identity.
    """
    return shift * sigma / (1 + (shift - 1) * sigma)


def student_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """The student's N-step grid: [1, (N-1)/N, ..., 1/N] before the shift, e.g. [1, .75, .5, .25].

    The step after the last one lands on sigma = 0 (the clean sample). Shape [N], float32.
    """
    unshifted = torch.linspace(1.0, 0.0, num_steps + 1)[:-1]
    return shift_sigma(unshifted, shift)


def teacher_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """An Euler ODE grid with its end point: [1, ..., 0], shape [N + 1]."""
    return shift_sigma(torch.linspace(1.0, 0.0, num_steps + 1), shift)


def timestep(sigma: Tensor) -> Tensor:
    """Model timestep for a (shifted) sigma: t = 1000 * sigma."""
    return sigma * TIMESTEP_SCALE


def _per_sample(sigma: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sample sigma [B] against a batch [B, ...]."""
    return sigma.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def add_noise(x0: Tensor, eps: Tensor, sigma: Tensor) -> Tensor:
    """x_s = (1 - sigma) * x0 + sigma * eps; sigma is per sample, shape [B]."""
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * eps


def velocity_target(x0: Tensor, eps: Tensor) -> Tensor:
    """The flow-matching target v = eps - x0."""
    return eps - x0


def x0_from_velocity(x_s: Tensor, sigma: Tensor, v: Tensor) -> Tensor:
    """x0 = x_s - sigma * v."""
    return x_s - _per_sample(sigma, x_s) * v


def cfg(v_pos: Tensor, v_neg: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance, standard form: v = v_neg + w * (v_pos - v_neg); w = 1 is unguided."""
    return v_neg + scale * (v_pos - v_neg)

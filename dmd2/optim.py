"""Optimizer construction and one optimizer step, shared by every trainer (in-process and on Ray)."""

import math
from typing import Callable

import torch
from torch import Tensor, nn

from dmd2.failures import NonFiniteError
from dmd2.tensors import figure, on_host

# (loss, grad norm) of this rank -> those of every rank, one row each (a data-parallel group's gather).
GatherFigures = Callable[[Tensor], Tensor]


def make_optimizer(
    params, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int,
    decay_steps: int = 0, total_steps: int = 0,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (the reference's optimizer) with a linear warmup to `lr`, constant, then, over the last
    `decay_steps` of `total_steps`, a linear decay towards 0 (warmup-stable-decay)."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, decay_steps, total_steps)
    )
    return optimizer, schedule


def lr_factor(step: int, warmup_steps: int, decay_steps: int = 0, total_steps: int = 0) -> float:
    """The learning rate of optimizer step `step` (0-based) over the peak: (step + 1) / warmup during the
    warmup; in the decay, (total - step) / decay: the decay's first step at the peak, its last at 1 / decay.
    Steps past `total_steps` (a run continued beyond its planned end) keep the last step's rate."""
    factor = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay_steps > 0:
        factor *= min(1.0, max(total_steps - step, 1) / decay_steps)
    return factor


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: Tensor,
    grad_clip: float | None,
    gather: GatherFigures | None = None,
) -> dict[str, float]:
    """Backward, clip, step; returns {loss, grad_norm (before clipping), lr (the lr this step used)}.

    A loss or gradient norm that is not finite on any rank (`gather` collects every rank's, so all
    ranks decide alike) raises `NonFiniteError` before the step: weights and optimizer state stay as
    they were. Clipping would not save such a step: it scales a NaN gradient to NaN.
    """
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    max_norm = grad_clip if grad_clip else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    loss_value, norm_value = figure(loss), figure(grad_norm)
    with on_host():  # figures on the host: every rank's, when a data-parallel group gathers them
        figures = torch.tensor([loss_value, norm_value], dtype=torch.float64)
        every_rank = gather(figures) if gather is not None else figures[None]
        finite = bool(torch.isfinite(every_rank).all())
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(_describe(every_rank))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return {"loss": loss_value, "grad_norm": norm_value, "lr": lr}


def _describe(every_rank: Tensor) -> str:
    """'loss = nan, grad norm = nan' (one rank), or each non-finite rank's figures."""
    rows = [(rank, loss, norm) for rank, (loss, norm) in enumerate(every_rank.tolist())
            if not (math.isfinite(loss) and math.isfinite(norm))]
    if len(every_rank) == 1:
        return f"loss = {rows[0][1]:.4g}, grad norm = {rows[0][2]:.4g}"
    return "; ".join(f"rank {rank}: loss = {loss:.4g}, grad norm = {norm:.4g}" for rank, loss, norm in rows)

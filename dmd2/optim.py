"""Optimizer construction and one optimizer step, shared by every trainer (in-process and on Ray)."""

import math

import torch
from torch import Tensor, nn


def make_optimizer(
    params, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (the reference's optimizer) with a linear warmup to `lr`, constant afterwards."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    warmup = max(warmup_steps, 0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, schedule


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: Tensor,
    grad_clip: float | None,
) -> dict[str, float]:
    """Backward, clip, step; returns {loss, grad_norm (before clipping), lr (the lr this step used)}."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    max_norm = grad_clip if grad_clip else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}

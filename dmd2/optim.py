"""Optimizer construction and one optimizer step, shared by every trainer (in-process and on Ray)."""

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmd2.failures import NonFiniteError
from dmd2.tensors import figure, on_host

# (loss, grad norm) of this rank -> those of every rank, one row each (a data-parallel group's gather).
GatherFigures = Callable[[Tensor], Tensor]


def make_optimizer(
    params, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int,
    decay_steps: int = 0, total_steps: int = 0, fused: bool | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (the reference's optimizer) with a linear warmup to `lr`, constant, then, over the last
    `decay_steps` of `total_steps`, a linear decay towards 0 (warmup-stable-decay).

    ``fused`` (default: when every parameter is on a GPU): one kernel per step instead of a launch per tensor
    group, and a step `optimizer_step` issues without waiting for its figures (it skips itself on the device
    where they are not finite). Elsewhere the default is AdamW's own (foreach), the arithmetic runs have always had.
    """
    params = list(params)
    if fused is None:
        fused = bool(params) and all(param.device.type == "cuda" for param in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
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
    sequence_ranks: int = 1,
) -> dict[str, float]:
    """Backward, clip, step; returns {loss, grad_norm (before clipping), lr (the lr this step used)}.

    A loss or gradient norm that is not finite on any rank (`gather` collects every rank's, so all
    ranks decide alike) raises `NonFiniteError`, and weights and optimizer state stay as they were.
    Clipping would not save such a step: it scales a NaN gradient to NaN.

    A fused AdamW (on a GPU, `make_optimizer`) steps before the figures are read, so nothing between the
    stage's forward and its update waits for the host: the finite check runs on the device, as the step's
    `found_inf` (the flag torch's GradScaler gives fused optimizers), which skips the update in the kernel.
    Otherwise the figures are read and checked first, and the step follows only if they are finite.

    ``sequence_ranks`` N > 1 (sequence parallelism, infra/trainers/sequence.py): this rank's gradients are its
    tokens' part of its sequence group's, which the data-parallel mean over all ranks would divide by N too many;
    backward differentiates N x the loss (exact in floating point for a power of 2), the figures keep the loss.
    """
    optimizer.zero_grad(set_to_none=True)
    (loss * sequence_ranks if sequence_ranks > 1 else loss).backward()
    max_norm = grad_clip if grad_clip else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = optimizer.param_groups[0]["lr"]
    fused = bool(optimizer.defaults.get("fused"))
    if fused:
        optimizer.found_inf = _not_finite_on_any_rank(loss, grad_norm)
        optimizer.step()
    loss_value, norm_value = figure(loss), figure(grad_norm)  # the step's one wait for the device
    with on_host():  # figures on the host: every rank's, when a data-parallel group gathers them
        figures = torch.tensor([loss_value, norm_value], dtype=torch.float64)
        every_rank = gather(figures) if gather is not None else figures[None]
        finite = bool(torch.isfinite(every_rank).all())
    if not finite:  # a fused step skipped itself on the device
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(_describe(every_rank))
    if not fused:
        optimizer.step()
    scheduler.step()
    return {"loss": loss_value, "grad_norm": norm_value, "lr": lr}


def _not_finite_on_any_rank(loss: Tensor, grad_norm: Tensor) -> Tensor:
    """1.0 where this rank's loss or the gradient norm is not finite on any rank, else 0.0: on the device, with
    no wait for the host (a data-parallel group all-reduces it on its own backend, as its gradients)."""
    flag = (~(torch.isfinite(loss.detach()) & torch.isfinite(_whole(grad_norm)))).float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def _whole(tensor: Tensor) -> Tensor:
    """A DTensor's whole value (FSDP2's gradient norm is one, replicated on every rank), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _describe(every_rank: Tensor) -> str:
    """'loss = nan, grad norm = nan' (one rank), or each non-finite rank's figures."""
    rows = [(rank, loss, norm) for rank, (loss, norm) in enumerate(every_rank.tolist())
            if not (math.isfinite(loss) and math.isfinite(norm))]
    if len(every_rank) == 1:
        return f"loss = {rows[0][1]:.4g}, grad norm = {rows[0][2]:.4g}"
    return "; ".join(f"rank {rank}: loss = {loss:.4g}, grad norm = {norm:.4g}" for rank, loss, norm in rows)

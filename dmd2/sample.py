"""Generating samples: the teacher's Euler ODE sampler and the student's few-step sampler."""

import torch
from torch import Tensor

from dmd2.model import Cond, VelocityFn, cond_rows, guided
from dmd2.rollout import backward_simulate, euler_sample
from dmd2.schedule import student_sigmas, teacher_sigmas
from dmd2.tensors import on_host

SAMPLERS = ("student", "teacher")


@torch.no_grad()
def generate(
    model: VelocityFn,
    cond: Cond,
    neg_cond: Cond,
    sample_shape: tuple[int, ...],
    *,
    sampler: str,
    num_steps: int,
    guidance_scale: float = 1.0,
    shift: float = 1.0,
    seed: int = 0,
    clamp: bool = True,
    rows: slice | None = None,
) -> Tensor:
    """Samples [B, *sample_shape], one per conditioning row; clamped to [-1, 1] unless `clamp` is False
    (latents are not images).

    `teacher`: deterministic Euler over N steps; `student`: the student's sampler (predict x0, re-noise
    to the next grid sigma with fresh noise), i.e. a rollout run to the end. Guidance is CFG over
    `neg_cond`. The same seed gives the same initial noise for both samplers. ``rows``: only these rows of
    the batch, from the noise they have in the whole batch (a rank's share of a split evaluation).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    batch = next(iter(cond.values())).shape[0]
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((batch, *sample_shape), generator=generator)
    renoise = (torch.randn((max(num_steps - 1, 0), batch, *sample_shape), generator=generator)
               if sampler == "student" else None)  # drawn for the whole batch, as the noise
    if rows is not None:
        noise, renoise = noise[rows], renoise[:, rows] if renoise is not None else None
        cond, neg_cond = cond_rows(cond, rows), cond_rows(neg_cond, rows)
    model = guided(model, guidance_scale, neg_cond)
    if sampler == "teacher":
        samples = euler_sample(model, noise, teacher_sigmas(num_steps, shift), cond)
        return samples.clamp(-1, 1) if clamp else samples
    with on_host():  # the stop steps are host bookkeeping (`backward_simulate` reads them there)
        stop = torch.full((noise.shape[0],), num_steps)
    _, x0, _ = backward_simulate(model, noise, student_sigmas(num_steps, shift), stop, cond, renoise)
    return x0.clamp(-1, 1) if clamp else x0

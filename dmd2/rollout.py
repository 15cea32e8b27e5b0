"""The student's few-step rollout with backward simulation (DMD2, Yin et al. 2024, §4.5).

DMD2 trains the student at every step of its own sampler: per sample a stop index i ~ U{0..N-1} is
drawn (or with `[dmd2] stop_weights`' odds), the student runs its steps before i (no grad), and the pair at step i — its input `x_i` and its
prediction `x0_hat_i` — is what the critic and the generator train on. The student's sampler predicts
x0 and re-noises it to the next grid sigma with fresh noise (consistency-style multistep sampling).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.conditioning import CondSource
from dmd2.draws import shard_rows
from dmd2.model import Cond, VelocityFn, cond_rows
from dmd2.plan import RolloutPlan
from dmd2.schedule import add_noise, student_sigmas, x0_from_velocity
from dmd2.tensors import on_host


@dataclass(frozen=True)
class RolloutSamples:
    """Student samples stopped at their step i; every tensor has one row per sample.

    x_i [M, C, H, W] (the student's input at step i), x0_hat [M, C, H, W] (its x0 prediction there),
    sigma [M] (sigma_i), step_index [M] int64 (i; N marks a full trajectory), cond / neg_cond (the
    positive and negative conditioning), sample_index [M] int64 (the row in the rollout's global batch).
    """

    x_i: Tensor
    x0_hat: Tensor
    sigma: Tensor
    step_index: Tensor
    cond: Cond
    neg_cond: Cond
    sample_index: Tensor

    def __len__(self) -> int:
        return self.x_i.shape[0]


@torch.no_grad()
def backward_simulate(
    student: VelocityFn,
    noise: Tensor,
    sigmas: Tensor,
    stop_index: Tensor,
    cond: Cond,
    renoise: Tensor,
    lockstep: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run each sample's steps before its stop index; return (x_i, x0_hat_i, sigma_i).

    noise [M, ...] starts every sample at sigmas[0]; sigmas [N] is the student's grid; stop_index [M]
    in [0, N] (N runs the whole trajectory: x_i = x0_hat = the final sample, sigma_i = 0);
    renoise [N - 1, M, ...] is the fresh noise of each transition j -> j + 1. Only samples still running
    are evaluated, so a sample stopping at i costs exactly i + 1 student calls.

    ``lockstep`` makes exactly N student calls whatever the stop indices, as a sharded (FSDP) student
    needs: its every forward is a collective, so all ranks must step through the grid together. A step
    with no sample left still runs, on one row whose result is dropped (a model cannot take 0 rows).
    The stop indices live on the host (`stop_index` is read to pick rows: no device sync), and every row
    choice is an index list made there (`on_host`), never a mask of device data.
    """
    num_steps = sigmas.shape[0]
    device = noise.device
    sigmas = sigmas.to(device)
    x = noise.clone()
    x_i, x0_hat = torch.empty_like(noise), torch.empty_like(noise)
    sigma_i = torch.zeros(noise.shape[0], device=device)
    with on_host():
        stop_index = stop_index.cpu()
    for j in range(num_steps):
        with on_host():  # the samples still running at step j; of them, which stop here and which go on
            rows = (stop_index >= j).nonzero().squeeze(1)
            stops = stop_index[rows] == j
            stopping, going = stops.nonzero().squeeze(1), (~stops).nonzero().squeeze(1)
            stop_rows, goes_on = rows[stopping], rows[going]
        if rows.numel() == 0:
            if not lockstep:
                break
            idle = torch.zeros(1, dtype=torch.long)
            student(x[idle], sigmas[j].expand(1), cond_rows(cond, idle))  # keeps the ranks' collectives in step
            continue
        sigma = sigmas[j].expand(rows.numel())
        x0 = x0_from_velocity(x[rows], sigma, student(x[rows], sigma, cond_rows(cond, rows)))
        x_i[stop_rows], x0_hat[stop_rows], sigma_i[stop_rows] = x[stop_rows], x0[stopping], sigmas[j]
        if j + 1 < num_steps:
            next_sigma = sigmas[j + 1].expand(goes_on.numel())
            x[goes_on] = add_noise(x0[going], renoise[j][goes_on], next_sigma)
        else:  # the last step lands on sigma = 0: the prediction is the sample
            x[goes_on] = x0[going]
    with on_host():
        done = (stop_index == num_steps).nonzero().squeeze(1)
    x_i[done], x0_hat[done] = x[done], x[done]
    return x_i, x0_hat, sigma_i


def stop_indices(plan: RolloutPlan, rows: Tensor) -> Tensor:
    """Each sample's stop step i [M]: uniform over the N steps, or with P(i) proportional to
    `plan.stop_weights[i]`, by the inverse CDF of the sample's own uniform draw. Host data (`on_host`).

    Weighting the later steps trains more often where the student's final output is made: every step's
    sample reaches the output through the steps after it, the last step's directly."""
    with on_host():
        if not plan.stop_weights:
            return plan.draws.integers("stop", plan.num_steps, rows)
        weights = torch.tensor(plan.stop_weights, dtype=torch.float64)
        cdf = (weights.cumsum(0) / weights.sum())[:-1]
        return torch.bucketize(plan.draws.uniform("stop", rows).double(), cdf, right=True)


def rollout_shard(student: VelocityFn, conds: CondSource, plan: RolloutPlan, rank: int,
                  device: torch.device | str = "cpu", lockstep: bool = False) -> RolloutSamples:
    """Backward-simulated student samples for this rank's K*B rows of the rollout's global batch.

    Every tensor is made on ``device`` (the student's) and stays there; ``lockstep``: see `backward_simulate`.
    """
    draws, rows = plan.draws, shard_rows(rank, plan.world_size, plan.critic_steps, plan.batch)
    stop_index = stop_indices(plan, rows)
    noise = draws.normal("noise", rows, plan.sample_shape, device)
    renoise = [draws.normal(f"renoise/{j}", rows, plan.sample_shape, device) for j in range(plan.num_steps - 1)]
    renoise = torch.stack(renoise) if renoise else noise.new_empty((0, *noise.shape))
    cond, neg_cond = conds(draws, rows)
    cond, neg_cond = ({key: value.to(device) for key, value in c.items()} for c in (cond, neg_cond))
    sigmas = student_sigmas(plan.num_steps, plan.shift)
    x_i, x0_hat, sigma = backward_simulate(student, noise, sigmas, stop_index, cond, renoise, lockstep)
    return RolloutSamples(x_i, x0_hat, sigma, stop_index, cond, neg_cond, rows)


@torch.no_grad()
def euler_sample(model: VelocityFn, noise: Tensor, sigmas: Tensor, cond: Cond) -> Tensor:
    """Deterministic Euler ODE sampler: x <- x + (sigma_next - sigma) * v, over sigmas [N + 1] ending at 0.

    This is how the teacher samples (its many-step reference); pass a `guided` model for CFG.
    """
    x = noise.clone()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        v = model(x, sigma.expand(x.shape[0]), cond)
        x = x + (sigma_next - sigma) * v
    return x

"""A diffusers scheduler that samples as the student's sampler: what a pipeline export carries, so that the stock
pipeline at the student's step count predicts x0 at each sigma of the student's grid and re-noises it to the next
(dmd2/rollout.py `backward_simulate` run to the end). Shared by the families that export diffusers pipelines."""

from typing import Any

import torch

from dmd2.conventions import TIMESTEP_SCALE
from dmd2.schedule import shift_sigma, student_sigmas

TIMESTEPS = int(TIMESTEP_SCALE)  # diffusers feeds the model t = num_train_timesteps * sigma
GRID_TOLERANCE = 1e-6


def _scheduler_sigma_min(shift: float) -> float:
    """The smallest sigma of FlowMatchEulerDiscreteScheduler's training grid, shift(1 / 1000), in its float32."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # slow to import; only exports need it

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=TIMESTEPS, shift=shift).sigma_min


def student_scheduler_config(num_steps: int, shift: float) -> dict[str, Any]:
    """A FlowMatchEulerDiscreteScheduler config whose `set_timesteps(num_steps)` grid is
    `student_sigmas(num_steps, shift)` followed by 0, and whose step predicts x0 and re-noises.

    diffusers 0.42's `set_timesteps(N)` spaces N sigmas linearly from 1 to its sigma_min = S_a(1/1000)
    (S_a: SD3's shift with parameter a = `shift`), shifts them with S_a, then (`shift_terminal` tau)
    stretches 1 - sigma so the last one is tau. The student's grid is S_s(1 - k/N), k < N, instead. In
    w = 1 - sigma, S_a is the Moebius map w -> w / (a - (a - 1) w) and the stretch a scale c, so the
    scheduler's k-th sigma is 1 - c kd / (a - (a - 1) kd), with d = (1 - sigma_min) / (N - 1), and the
    student's 1 - (k/N) / (s - (s - 1) k/N): equal for every k iff a = 1 / (1 - (s - 1) / (d s N)) and
    the last one matches, i.e. tau = S_s(1/N). sigma_min depends (slightly) on a: a fixed point.
    """
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"[student] num_steps must be >= 1 and shift > 0, got {num_steps} and {shift}")
    config = {"num_train_timesteps": TIMESTEPS, "use_dynamic_shifting": False, "invert_sigmas": False,
              "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
              "stochastic_sampling": True}  # step: x0 = x_s - sigma v, then (1 - sigma') x0 + sigma' eps
    if num_steps == 1:  # the grid is [1, 0] whatever the shift; a stretch would divide by zero
        return {**config, "shift": float(shift), "shift_terminal": None}
    scheduler_shift = float(shift)
    for _ in range(20):  # converges in a few rounds: sigma_min moves by ~1e-3 per unit of the shift
        spacing = (1.0 - _scheduler_sigma_min(scheduler_shift)) / (num_steps - 1)
        # spacing * num_steps >= 1, so the denominator is > 1/s > 0 for every shift s > 0
        previous, scheduler_shift = scheduler_shift, 1.0 / (1.0 - (shift - 1.0) / (spacing * shift * num_steps))
        if abs(scheduler_shift - previous) < 1e-12:
            break
    terminal = float(shift_sigma(torch.tensor(1.0 / num_steps, dtype=torch.float64), shift))
    return {**config, "shift": scheduler_shift, "shift_terminal": terminal}


def check_student_grid(scheduler: Any, num_steps: int, shift: float) -> None:
    """Refuse a scheduler whose N-step grid is not the student's (e.g. a diffusers release that changed it)."""
    scheduler.set_timesteps(num_steps)
    expected = torch.cat([student_sigmas(num_steps, shift), torch.zeros(1)])
    got = scheduler.sigmas.to(torch.float32)
    if got.shape != expected.shape or (got - expected).abs().max() > GRID_TOLERANCE:
        raise RuntimeError(f"the exported scheduler's {num_steps}-step sigmas {got.tolist()} differ from the "
                           f"student's {expected.tolist()}; this diffusers version builds its grid differently: "
                           f"update student_scheduler_config (dmd2/flow_scheduler.py)")


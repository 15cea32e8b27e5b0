"""Mixed precision for a velocity call: bf16 compute, fp32 everywhere else.

Under `Autocast` the model's matmuls and convolutions run in bf16 while its fp32 parameters stay the
master weights (the optimizer and its state see only fp32), and the velocity comes back in fp32, so
losses, the DMD gradient, sigmas and timesteps (t = 1000 sigma, formed by the caller in fp32) never
round to bf16's 8 bits of mantissa, which would put `1000 * sigma` on steps of 4.
"""

import torch
from torch import Tensor

from dmd2.config import DistillConfig
from dmd2.model import Cond, VelocityFn


class Autocast:
    """`velocity_fn` computed under torch.autocast(bf16) on `device_type`; returns float32."""

    def __init__(self, velocity_fn: VelocityFn, device_type: str):
        self.velocity_fn, self.device_type = velocity_fn, device_type

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.velocity_fn(x_s, sigma, cond).float()

    @property
    def guided(self):
        """The wrapped velocity's own guidance (`dmd2.model.guided`), computed under autocast too; None: plain CFG
        around this (in fp32, as before)."""
        own = getattr(self.velocity_fn, "guided", None)
        return own and (lambda scale, neg_cond: Autocast(own(scale, neg_cond), self.device_type))


def in_run_precision(velocity_fn: VelocityFn, config: DistillConfig, device_type: str) -> VelocityFn:
    """``velocity_fn`` as the run computes it: under `Autocast` with `[train] mixed_precision = "bf16"`."""
    return Autocast(velocity_fn, device_type) if config.train.mixed_precision == "bf16" else velocity_fn


def teacher_dtype(config: DistillConfig) -> torch.dtype | None:
    """The frozen teacher's dtype: bf16 under `mixed_precision = "bf16"` (no master weights to keep), else the
    family's default."""
    return torch.bfloat16 if config.train.mixed_precision == "bf16" else None

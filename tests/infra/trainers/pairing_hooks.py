"""Hooks for the rank-pairing test: each group's output says which rank made it and what it received.

Outputs are `Scores` records (a payload type the store may carry): ``x0_real`` is filled with the
producing rank, ``x0_fake`` with the rank found in ``external_data["critic"]`` (-1 when there is
none), ``sigma`` with the process id that deserialised the external payload (0 when none).
"""

import os

import torch

from dmd2.scoring import Scores


def tiny_loss(ctx, model, batch, step):
    """A real loss through the model, so DDP has gradients to average."""
    return model(batch.latent, batch.sigma, batch.cond).pow(2).mean(), {"external": float(len(ctx.external_data))}, None


def rank_output(ctx, kept):
    external = ctx.external_data.get("critic")
    rows = 2
    received = float(external.x0_real.flatten()[0]) if external is not None else -1.0
    return Scores(
        sample_index=torch.arange(rows),
        sigma=torch.full((rows,), float(os.getpid()) if external is not None else 0.0, dtype=torch.float64),
        x0_real=torch.full((rows, 1), float(ctx.rank)),
        x0_fake=torch.full((rows, 1), received),
    )

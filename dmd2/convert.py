"""Rollout samples -> train pairs: one pair per backward-simulated sample (docs/architecture.md §1 step 2)."""

from dataclasses import dataclass

from torch import Tensor

from dmd2.model import Cond
from dmd2.rollout import RolloutSamples
from dmd2.schedule import timestep
from dmd2.tensors import on_host


@dataclass(frozen=True)
class TrainPairs:
    """What the critic and the actor train on; one row per sample.

    latent [M, C, H, W] = x_i, x0 [M, C, H, W] = x0_hat_i (the student's prediction, no grad),
    sigma [M] = sigma_i, timestep [M] = 1000 * sigma_i, step_index [M] = i, cond / neg_cond,
    sample_index [M] (the row in the rollout's global batch, the key scores are matched by).
    """

    latent: Tensor
    x0: Tensor
    sigma: Tensor
    timestep: Tensor
    step_index: Tensor
    cond: Cond
    neg_cond: Cond
    sample_index: Tensor

    def __len__(self) -> int:
        return self.latent.shape[0]


def samples_to_train_pairs(samples: RolloutSamples, num_steps: int) -> TrainPairs:
    """One train pair per stopped sample. Rewards, if a rollout carried any, play no part in DMD2.

    A full trajectory (step_index == num_steps) has no student step to train and is rejected.
    """
    with on_host():
        full = (samples.step_index >= num_steps).nonzero().squeeze(1)
    if full.numel():
        raise ValueError(
            f"{full.numel()} of {len(samples)} samples ran the full {num_steps}-step trajectory "
            f"(sample_index {samples.sample_index[full[:5]].tolist()}...); DMD2 trains on samples stopped "
            "at a random step: roll out with backward simulation (stop indices in [0, num_steps))"
        )
    return TrainPairs(
        latent=samples.x_i,
        x0=samples.x0_hat,
        sigma=samples.sigma,
        timestep=timestep(samples.sigma),
        step_index=samples.step_index,
        cond=samples.cond,
        neg_cond=samples.neg_cond,
        sample_index=samples.sample_index,
    )

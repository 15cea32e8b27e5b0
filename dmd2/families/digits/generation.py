"""Sampling a class-conditional digits UNet for given labels: `dmd2 sample` and the exported student's
generator (the logged MLflow model) share it, so both draw the same pixels for the same seed."""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dmd2.model import DiffusersVelocity
from dmd2.sample import generate


def label_count(model: nn.Module) -> int:
    """The model's class labels, the null class (its last label embedding) excluded; ValueError if it has none."""
    classes = getattr(model.config, "num_class_embeds", None)
    if not classes or classes < 2:
        raise ValueError("the model is not class-conditional (no num_class_embeds); class labels condition "
                         "only class-conditional models such as the digits teacher")
    return classes - 1


def sample_labels(model: nn.Module, labels: Tensor, *, sampler: str, num_steps: int, guidance_scale: float = 1.0,
                  shift: float = 1.0, seed: int = 0) -> Tensor:
    """Samples [N, C, H, W] in [-1, 1] of a class-conditional UNet, one per label; CFG's negative is the null class."""
    null = label_count(model)
    size = model.config.sample_size
    shape = (model.config.in_channels, *(size if isinstance(size, (list, tuple)) else (size, size)))
    return generate(DiffusersVelocity(model), {"class_labels": labels},
                    {"class_labels": torch.full_like(labels, null)}, shape, sampler=sampler, num_steps=num_steps,
                    guidance_scale=guidance_scale, shift=shift, seed=seed)


def to_pixels(images: Tensor) -> np.ndarray:
    """Images [N, 1, H, W] in [-1, 1] as uint8 pictures [N, H, W] (as the sample grid maps them)."""
    return ((images[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()


@dataclass
class DigitsGenerator:
    """An exported digits student, loaded once: class labels in, uint8 pictures [8, 8] out (student sampler)."""

    model: nn.Module
    num_steps: int
    shift: float

    def __call__(self, inputs: list[Any], seed: int = 0) -> list[np.ndarray]:
        labels = torch.tensor([_label(value) for value in inputs], dtype=torch.int64)
        classes = label_count(self.model)
        if len(labels) and (labels.min() < 0 or labels.max() >= classes):
            raise ValueError(f"class labels must lie in 0..{classes - 1}, got {sorted(set(labels.tolist()))}")
        images = sample_labels(self.model, labels, sampler="student", num_steps=self.num_steps, shift=self.shift,
                               seed=seed)
        return list(to_pixels(images))


def _label(value: Any) -> int:
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not number or not np.isfinite(value) or value != int(value):
        raise ValueError(f"a class label is an integer, got {value!r}")
    return int(value)

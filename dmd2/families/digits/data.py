"""sklearn's bundled 8x8 digits as the built-in recipe's data set (loaded and split by `dmd2.digits_dataset`):
the GAN's real samples and the evaluator's balanced labels.
"""

from __future__ import annotations

import torch

from dmd2.families.digits.checks import IMAGE_SHAPE, NULL_CLASS, NUM_CLASSES  # noqa: F401 (the data's shape)
from dmd2.digits_dataset import DigitsSplits, load_digits_splits  # noqa: F401 (the family's data, re-exported)
from dmd2.gan import RealSamples


def real_digits() -> RealSamples:
    """The GAN's real samples (dmd2/gan.py): the train split the teacher was pretrained on, in its scaling
    ([-1, 1]), each with its label as the cond."""
    splits = load_digits_splits()
    return RealSamples(splits.train_images, {"class_labels": splits.train_labels})


def balanced_labels(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` labels cycling ``0, 1, ..., 9, 0, 1, ...``: equal counts when 10 divides ``n``.

    Args:
        n: number of labels, ``>= 0``.
        generator: if given, the cycled labels are shuffled with it (same counts, random order);
            if None, they come in cycling order.

    Returns:
        int64 ``[n]``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    labels = torch.arange(n, dtype=torch.int64) % NUM_CLASSES
    if generator is not None:
        labels = labels[torch.randperm(n, generator=generator)]
    return labels

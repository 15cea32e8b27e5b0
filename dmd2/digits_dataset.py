"""sklearn's bundled 8x8 digits, split once: the data both built-in teachers learn from (the digits family's
class-conditional UNet, and the SD3 family's captioned pipeline) and the digits judge is trained on.

Images are float32 ``[N, 1, 8, 8]`` in ``[-1, 1]`` (pixel values 0..16 mapped by ``x / 8 - 1``),
labels int64 ``[N]`` in ``0..9``. The data ships inside scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IMAGE_SHAPE = (1, 8, 8)  # (channels, height, width) of one digit
_PIXEL_MAX = 16.0  # sklearn's digits are 4-bit counts of set pixels in each 4x4 block


@dataclass(frozen=True)
class DigitsSplits:
    """A stratified train / held-out split of the digits.

    Attributes:
        train_images: float32 ``[N_train, 1, 8, 8]`` in ``[-1, 1]``.
        train_labels: int64 ``[N_train]`` in ``0..9``.
        test_images: float32 ``[N_test, 1, 8, 8]`` in ``[-1, 1]``, never used for training
            (neither the generator nor the evaluator's classifier).
        test_labels: int64 ``[N_test]`` in ``0..9``.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


def _to_images(pixels: np.ndarray) -> torch.Tensor:
    """``[N, 64]`` pixel counts 0..16 -> float32 ``[N, 1, 8, 8]`` in ``[-1, 1]``: ``x / 8 - 1``."""
    scaled = pixels.astype(np.float32) / (_PIXEL_MAX / 2) - 1.0
    return torch.from_numpy(scaled.reshape(-1, *IMAGE_SHAPE))


def load_digits_splits(test_fraction: float = 0.2, seed: int = 0) -> DigitsSplits:
    """Load sklearn's digits and split them, stratified by class, deterministically for ``seed``.

    Args:
        test_fraction: share of each class held out, in ``(0, 1)``.
        seed: seed of the split; the same seed always gives the same split.

    Returns:
        DigitsSplits with ``round(1797 * test_fraction)`` held-out images (sklearn's rounding).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"test_fraction must lie in (0, 1), got {test_fraction}; 0.2 is the default."
        )
    from sklearn.datasets import load_digits  # slow to import: only loading the data needs it
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data,
        digits.target,
        test_size=test_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    return DigitsSplits(
        train_images=_to_images(x_train),
        train_labels=torch.from_numpy(y_train.astype(np.int64)),
        test_images=_to_images(x_test),
        test_labels=torch.from_numpy(y_test.astype(np.int64)),
    )

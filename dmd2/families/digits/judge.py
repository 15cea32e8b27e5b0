"""The digits classifier as a judge of another family's RGB pictures (`[eval] feature_model = "builtin:digits"`):
a text-to-image student of digits (the SD3 family's built-in teacher draws them) is scored in the features the
digits yardstick uses, and its pictures read back as digits.

Reached through the family registry (`dmd2.family.family_judge("digits")`), so no other family imports this
family's code.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from dmd2.families.digits.data import IMAGE_SHAPE, load_digits_splits
from dmd2.families.digits.evaluator import DigitsEvaluator


def digit_pixels(images: Tensor) -> Tensor:
    """RGB pictures [N, 3, H, W] in [-1, 1] -> the classifier's input [N, 1, 8, 8]: grey (the mean of the channels),
    area-downsampled to 8 x 8. The digits' own range is [-1, 1], ink at 1 on a background of -1 (sklearn's counts
    0..16 as x / 8 - 1), so a picture drawn that way (the SD3 built-in teacher's: each digit pixel doubled, grey in
    RGB) comes back as its digit exactly."""
    grey = images.float().clamp(-1, 1).mean(dim=1, keepdim=True)
    return F.adaptive_avg_pool2d(grey, IMAGE_SHAPE[1:])


@dataclass(frozen=True)
class DigitsJudge:
    """The digits yardstick's classifier (trained once on the train split, cached in ``cache_dir``), on CPU."""

    evaluator: DigitsEvaluator

    @classmethod
    def load(cls, cache_dir: str | Path) -> "DigitsJudge":
        """The classifier cached in ``cache_dir``, trained there on first use (~30 s on CPU)."""
        with torch.enable_grad():  # an evaluator loads it at its first scoring, under no_grad: training needs grads
            return cls(DigitsEvaluator.load_or_train(cache_dir, load_digits_splits()))

    def features(self, images: Tensor) -> Tensor:
        """The classifier's penultimate features [N, 64] of RGB pictures [N, 3, H, W] in [-1, 1]."""
        return self.evaluator.features(digit_pixels(images))

    def classify(self, images: Tensor) -> Tensor:
        """The digit [N] (int64) the classifier reads in each RGB picture."""
        return self.evaluator.predict(digit_pixels(images))

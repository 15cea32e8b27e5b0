"""The digits yardstick: quality against real data, fidelity against the teacher, accuracy
(docs/architecture.md, "The digits yardstick").

Every generated set is scored the same way: N samples with balanced labels from a fixed seed, features
from the project's evaluator, FD against the held-out split (quality) and against the teacher's own
many-step guided samples (fidelity), and the fraction classified as the requested digit. A second judge, which
no model of this project trained: KID on the pixels themselves against the teacher's samples (`pixel_kid_teacher`,
dmd2/metrics.py), so that a recipe tuned on the evaluator's features cannot flatter only them.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dmd2.conditioning import ClassLabels
from dmd2.families.digits.data import IMAGE_SHAPE, NULL_CLASS, NUM_CLASSES, DigitsSplits, balanced_labels
from dmd2.families.digits.evaluator import DigitsEvaluator, fd_between
from dmd2.metrics import kid_to_reference
from dmd2.model import Cond, VelocityFn
from dmd2.sample import generate

DIGIT_CONDS = ClassLabels(NUM_CLASSES, NULL_CLASS)
# The teacher's reference set uses its own noise, so the teacher row at the same settings measures the
# sampling floor instead of scoring a set against itself.
REFERENCE_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Yardstick:
    evaluator: DigitsEvaluator
    labels: Tensor
    real_features: np.ndarray
    teacher_features: np.ndarray
    teacher_pixels: Tensor  # the teacher's reference samples, flattened: the model-free judge's reference
    seed: int

    @classmethod
    def build(
        cls, evaluator: DigitsEvaluator, splits: DigitsSplits, teacher: VelocityFn, *,
        num_samples: int, reference_steps: int, guidance_scale: float, seed: int = 0,
    ) -> "Yardstick":
        labels = balanced_labels(num_samples)
        cond, neg_cond = DIGIT_CONDS.for_labels(labels)
        reference = generate(teacher, cond, neg_cond, IMAGE_SHAPE, sampler="teacher", num_steps=reference_steps,
                             guidance_scale=guidance_scale, seed=seed + REFERENCE_SEED_OFFSET)
        return cls(evaluator, labels, evaluator.features(splits.test_images).numpy(),
                   evaluator.features(reference).numpy(), reference.flatten(1), seed)

    @property
    def conds(self) -> tuple[Cond, Cond]:
        return DIGIT_CONDS.for_labels(self.labels)

    def score(self, images: Tensor, labels: Tensor | None = None) -> dict[str, float]:
        """{fd_real, fd_teacher, pixel_kid_teacher, accuracy} of images generated for `labels` (default: the
        yardstick's)."""
        labels = self.labels if labels is None else labels
        features = self.evaluator.features(images).numpy()
        return {
            "fd_real": fd_between(features, self.real_features),
            "fd_teacher": fd_between(features, self.teacher_features),
            "pixel_kid_teacher": kid_to_reference(images.flatten(1), self.teacher_pixels, (labels, self.labels)),
            "accuracy": self.evaluator.accuracy(images, labels),
        }

    def score_model(self, model: VelocityFn, *, sampler: str, num_steps: int, guidance_scale: float = 1.0,
                    shift: float = 1.0) -> dict[str, float]:
        """Generate the yardstick's N samples with `model` and score them."""
        cond, neg_cond = self.conds
        images = generate(model, cond, neg_cond, IMAGE_SHAPE, sampler=sampler, num_steps=num_steps,
                          guidance_scale=guidance_scale, shift=shift, seed=self.seed)
        return self.score(images)


def sample_grid(images: Tensor, columns: int = 10, scale: int = 4) -> np.ndarray:
    """Images [N, 1, H, W] in [-1, 1] as one uint8 picture (rows of `columns`, each pixel `scale` x `scale`)."""
    n, _, height, width = images.shape
    rows = -(-n // columns)
    canvas = torch.full((rows * (height + 1) + 1, columns * (width + 1) + 1), -1.0)
    for i, image in enumerate(images[:, 0]):
        top, left = 1 + (i // columns) * (height + 1), 1 + (i % columns) * (width + 1)
        canvas[top:top + height, left:left + width] = image
    pixels = ((canvas.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.repeat_interleave(scale, 0).repeat_interleave(scale, 1).numpy()

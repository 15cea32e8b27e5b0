"""Evaluating a run's student in the driver: the digits yardstick and a sample grid.

The student's weights come from the actor group as a state dict in the store; the driver loads them
into the teacher's architecture (the digits models are tiny; a large model would evaluate on its ranks).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dmd2.config import DistillConfig
from dmd2.digits.data import IMAGE_SHAPE, load_digits_splits
from dmd2.digits.evaluator import DigitsEvaluator
from dmd2.digits.yardstick import Yardstick, sample_grid
from dmd2.model import DiffusersVelocity
from dmd2.sample import generate
from infra.models import load_model
from infra.store import ArtifactRef, ArtifactStore

GRID_LABELS = torch.arange(100) % 10  # ten of each digit, one digit per column


@dataclass
class StudentEvaluator:
    """Scores a student checkpoint of one run; built once (teacher reference samples are not cheap)."""

    config: DistillConfig
    teacher_path: str
    yardstick: Yardstick

    @classmethod
    def build(cls, config: DistillConfig, teacher_path: str, cache_dir: Path) -> "StudentEvaluator":
        splits = load_digits_splits()
        teacher = DiffusersVelocity(load_model(teacher_path).eval())
        yardstick = Yardstick.build(DigitsEvaluator.load_or_train(cache_dir, splits), splits, teacher,
                                    num_samples=config.eval.num_samples, reference_steps=config.eval.reference_steps,
                                    guidance_scale=config.dmd2.teacher_guidance_scale, seed=config.train.seed)
        return cls(config, teacher_path, yardstick)

    def load_student(self, store: ArtifactStore, weights: ArtifactRef) -> nn.Module:
        model = load_model(self.teacher_path)
        model.load_state_dict(store.get_tensors(weights))
        return model.eval()

    def evaluate(self, student: nn.Module) -> tuple[dict[str, float], np.ndarray]:
        """({eval/fd_real, eval/fd_teacher, eval/accuracy}, a 10 x 10 sample grid as uint8)."""
        velocity, student_config = DiffusersVelocity(student), self.config.student
        scores = self.yardstick.score_model(velocity, sampler="student", num_steps=student_config.num_steps,
                                            shift=student_config.shift)
        cond = {"class_labels": GRID_LABELS}
        images = generate(velocity, cond, {"class_labels": torch.full_like(GRID_LABELS, 10)}, IMAGE_SHAPE,
                          sampler="student", num_steps=student_config.num_steps, shift=student_config.shift,
                          seed=self.config.train.seed)
        return {f"eval/{key}": value for key, value in scores.items()}, sample_grid(images)

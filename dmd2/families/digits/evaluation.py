"""The digits family's evaluation of a student: the yardstick's scores and a 10 x 10 sample grid.

Runs on the trainer group's rank 0 (docs/architecture.md §5); the driver only logs what it returns.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from dmd2.config import DistillConfig
from dmd2.family import Evaluation
from dmd2.families.digits.data import IMAGE_SHAPE, NULL_CLASS, NUM_CLASSES, load_digits_splits
from dmd2.families.digits.evaluator import DigitsEvaluator
from dmd2.families.digits.yardstick import Yardstick, sample_grid
from dmd2.model import DiffusersVelocity, VelocityFn, load_pretrained
from dmd2.sample import generate

GRID_LABELS = torch.arange(100) % NUM_CLASSES  # ten of each digit, one digit per column


@dataclass
class DigitsStudentEvaluator:
    """Scores students of one run; built once (the teacher's reference samples are not cheap)."""

    config: DistillConfig
    teacher: VelocityFn
    yardstick: Yardstick

    @classmethod
    def build(cls, config: DistillConfig, cache_dir: Path) -> "DigitsStudentEvaluator":
        splits = load_digits_splits()
        # Loading initialises weights from the global RNG first: keep the caller's RNG untouched.
        with torch.random.fork_rng(devices=[]):
            teacher = DiffusersVelocity(load_pretrained(config.model.teacher).eval().requires_grad_(False))
        yardstick = Yardstick.build(DigitsEvaluator.load_or_train(cache_dir, splits), splits, teacher,
                                    num_samples=config.eval.num_samples, reference_steps=config.eval.reference_steps,
                                    guidance_scale=config.dmd2.teacher_guidance_scale, seed=config.train.seed)
        return cls(config, teacher, yardstick)

    @torch.no_grad()
    def evaluate(self, student: VelocityFn) -> Evaluation:
        """{eval/fd_real, eval/fd_teacher, eval/accuracy} and the sample grid (uint8) as media `samples`."""
        steps, shift = self.config.student.num_steps, self.config.student.grid_shift
        scores = self.yardstick.score_model(student, sampler="student", num_steps=steps, shift=shift)
        images = generate(student, {"class_labels": GRID_LABELS},
                          {"class_labels": torch.full_like(GRID_LABELS, NULL_CLASS)}, IMAGE_SHAPE,
                          sampler="student", num_steps=steps, shift=shift, seed=self.config.train.seed)
        return Evaluation({f"eval/{key}": value for key, value in scores.items()}, {"samples": sample_grid(images)})

    @torch.no_grad()
    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """The teacher at its reference steps and at the student's, and the untrained student (the
        teacher's weights sampled the student's way): the rows a DMD2 student is read against."""
        steps, guidance = self.config.student.num_steps, self.config.dmd2.teacher_guidance_scale
        rows = [(f"teacher, {n} steps, guidance {guidance:g}",
                 self.yardstick.score_model(self.teacher, sampler="teacher", num_steps=n, guidance_scale=guidance))
                for n in (self.config.eval.reference_steps, steps)]
        rows.append((f"untrained student, {steps} steps",
                     self.yardstick.score_model(self.teacher, sampler="student", num_steps=steps)))
        return [(name, {f"eval/{key}": value for key, value in scores.items()}) for name, scores in rows]

    def reference_media(self) -> dict:
        return {}  # the baselines' scores say it; a digits grid of the teacher adds nothing to read

    def references_id(self) -> str:
        return "digits"

    def references(self) -> dict:
        return {}  # the yardstick's reference statistics are cached by the family, not per run

    def with_references(self, tensors: dict) -> None:
        pass

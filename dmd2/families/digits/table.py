"""The digits quality table: teacher, untrained student and DMD2 students on one yardstick.

This is the in-process benchmark of the DMD2 core (no orchestration): pretrain (or load) the teacher,
distill a 4-step and a 1-step student with `dmd2.loop`, and score every row the same way.
"""

import copy
import logging
import time
from pathlib import Path

import torch

from dmd2.config import DistillConfig
from dmd2.families.digits.data import load_digits_splits
from dmd2.families.digits.evaluator import DigitsEvaluator
from dmd2.families.digits.family import DigitsFamily
from dmd2.families.digits.pretrain import resolve_model
from dmd2.families.digits.yardstick import Yardstick
from dmd2.loop import InProcessDistiller
from dmd2.model import DiffusersVelocity, load_pretrained

log = logging.getLogger(__name__)


DISTILL_SECONDS = "time/distill_s"  # a student row's wall time: distilling it and scoring it
Row = tuple[str, dict[str, float]]  # (name, {eval/fd_real, eval/fd_teacher, eval/accuracy}): see dmd2.report


def _row(name: str, scores: dict[str, float]) -> Row:
    return name, {f"eval/{key}": value for key, value in scores.items()}


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def teacher_row_name(steps: int, guidance: float) -> str:
    return f"teacher, {_steps(steps)}, guidance {guidance:g}"


def _distill(config: DistillConfig, teacher: torch.nn.Module, cache_dir: Path, name: str) -> torch.nn.Module:
    """The recipe's student (default: a copy of the teacher) and critic, distilled in process; with
    `[student] ema_decay` the student holds its EMA's weights, as a flow's evaluation and export do."""

    def load(spec: str | None) -> torch.nn.Module | None:
        return load_pretrained(resolve_model(spec, cache_dir)) if spec else None

    distiller = InProcessDistiller.for_family(config, DigitsFamily(), cache_dir, teacher,  # GAN and LoRA as a run's
                                              student=load(config.model.student), critic=load(config.model.critic_load))
    return distiller.distilled(name)


def quality_table(recipes: dict[str, DistillConfig], cache_dir: Path) -> list[Row]:
    """The rows of the digits yardstick (docs/architecture.md) for the teacher of the first recipe,
    then one DMD2 student per recipe.

    `recipes` maps a row name ("DMD2 student, 4 steps") to its config; all share the teacher and its
    guidance (the first recipe's [dmd2] teacher_guidance_scale).
    """
    first = next(iter(recipes.values()))
    guidance, ev = first.dmd2.teacher_guidance_scale, first.eval
    splits = load_digits_splits()
    evaluator = DigitsEvaluator.load_or_train(cache_dir, splits)
    teacher = load_pretrained(resolve_model(first.model.teacher, cache_dir)).eval()
    teacher_fn = DiffusersVelocity(teacher)
    yardstick = Yardstick.build(evaluator, splits, teacher_fn, num_samples=ev.num_samples,
                                reference_steps=ev.reference_steps, guidance_scale=guidance, seed=first.train.seed)
    real = splits.train_images[: ev.num_samples], splits.train_labels[: ev.num_samples]
    rows = [_row("real data (train split vs held-out)", yardstick.score(*real))]
    for scale in (guidance, 1.0):
        for steps in (ev.reference_steps, 4, 1):
            scores = yardstick.score_model(teacher_fn, sampler="teacher", num_steps=steps, guidance_scale=scale)
            rows.append(_row(teacher_row_name(steps, scale), scores))
    for steps in (4, 1):
        scores = yardstick.score_model(teacher_fn, sampler="student", num_steps=steps)
        rows.append(_row(f"untrained student, {_steps(steps)}", scores))
    for name, config in recipes.items():
        started = time.monotonic()
        student = _distill(config, copy.deepcopy(teacher), cache_dir, name)
        scores = yardstick.score_model(DiffusersVelocity(student), sampler="student",
                                       num_steps=config.student.num_steps, shift=config.student.grid_shift)
        seconds = time.monotonic() - started
        log.info("%s distilled in %.0f s", name, seconds)
        rows.append((name, _row(name, scores)[1] | {DISTILL_SECONDS: seconds}))
    return rows

"""The text-to-image quality table: the teacher at many and few guided steps, the untrained and the distilled
student, each scored by the SD3 evaluator against the teacher's many-step samples of the eval set.

In process (no orchestration), like the digits table: the recipe's teacher is resolved (the built-in one trained
if missing), the prompts encoded, and the student distilled with `dmd2.loop`. Every row is the evaluator's scores
(dmd2/families/sd3/evaluation.py): the distance to the teacher's samples by two judges (the feature model's KID,
and KID on pixels), diversity beside the teacher's, and the prompt accuracy where the judge reads digits. Every
row samples the student's noise and the reference its own, so the teacher's many-step row is the floor a set of
this size reaches.
"""

import copy
import time
from pathlib import Path

import torch

from dmd2.config import DistillConfig
from dmd2.families.sd3.family import SD3Family
from dmd2.loop import InProcessDistiller
from dmd2.sample import generate

DISTILL_SECONDS = "time/distill_s"  # the student row's wall time: distilling it and scoring it
Row = tuple[str, dict[str, float]]


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _distill(config: DistillConfig, family: SD3Family, teacher: torch.nn.Module, cache_dir: Path) -> torch.nn.Module:
    """The recipe's student distilled in process; with `[student] ema_decay` its EMA's weights, as a flow's
    evaluation and export."""
    distiller = InProcessDistiller.for_family(config, family, cache_dir, teacher)
    return distiller.distilled(f"DMD2 student, {_steps(config.student.num_steps)}")


def quality_table(config: DistillConfig, cache_dir: Path) -> list[Row]:
    """The rows of the text-to-image table for one sd3 recipe (module docstring), in this order: the teacher at
    `[eval] reference_steps`, the teacher at the student's step count, the untrained student, the
    distilled one."""
    family = SD3Family()
    config = family.resolve(config, cache_dir)
    family = family.bind(family.prepare(config))
    evaluator = family.evaluator(config, cache_dir)
    teacher = family.load_model(config.model.teacher).eval().requires_grad_(False)
    guidance, steps = config.dmd2.teacher_guidance_scale, config.student.num_steps
    reference = config.eval.reference_steps
    cond, neg = evaluator.conds()
    many_steps = generate(family.velocity(teacher), cond, neg, evaluator.latent_shape(), sampler="teacher",
                          num_steps=reference, guidance_scale=guidance, shift=config.student.grid_shift,
                          seed=config.train.seed, clamp=False)
    rows = [(f"teacher, {_steps(reference)}, guidance {guidance:g}", evaluator.score(many_steps).scores)]
    rows += evaluator.baselines()
    rows.append((f"untrained student, {_steps(steps)}", evaluator.evaluate(family.velocity(teacher)).scores))
    started = time.monotonic()
    student = _distill(config, family, copy.deepcopy(teacher), cache_dir)
    scores = evaluator.evaluate(family.velocity(student)).scores
    rows.append((f"DMD2 student, {_steps(steps)}", scores | {DISTILL_SECONDS: time.monotonic() - started}))
    return rows


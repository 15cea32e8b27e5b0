"""An evaluation of a prompt-conditioned student over a fixed eval set, its samples compared with the teacher's: what
the text families' evaluators share (SD3's pictures, Wan's videos), apart from how samples are decoded and scored.

The eval set is the eval prompts, each sampled from `[eval] samples_per_prompt` noises (row k P + p: prompt p of P,
noise k), the same seeded noise every evaluation. The teacher is loaded once per evaluator for its two sets of
samples (`teacher_samples`: its many-step reference from noise of its own, and its few-step baseline from the
student's noise), which the rank stores and hands to the evaluator of a later rank process of the same run
(`references`, `with_references`); the ranks can share the sampling (`student_share`, `teacher_share`).

A subclass gives `latent_shape`, `decode` (latents to pixels), `_spaces` (pixels to the features its scores read),
`_scores`, `score` and `reference_media`.
"""

import hashlib
import json
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig
from dmd2.family import Evaluation, default_cache_dir
from dmd2.model import HostCalls, VelocityFn
from dmd2.precision import in_run_precision, teacher_dtype
from dmd2.prompt_file import read_prompts
from dmd2.prompt_index import negative_indices, prompt_indices
from dmd2.sample import generate

# The reference's noise is not the student's: KID assumes independent sets, and a student's picture drawn from the
# same noise as its reference picture shares much of it, which biases the estimate down (the digits yardstick does
# the same). The teacher at the reference's settings from the student's noise then measures the floor.
REFERENCE_SEED_OFFSET = 1_000_003
DECODE_BATCH = 4  # latents per VAE decode: at 1024 px the decoder's activations take GBs per picture


def image_grid(images: Tensor, columns: int | None = None, border: int = 2) -> np.ndarray:
    """Images [N, 3, H, W] in [-1, 1] in rows of ``columns`` (default: one row) as one uint8 picture
    [R (H + b) + b, C (W + b) + b, 3], R = ceil(N / C) rows, image i at row i // C, column i % C."""
    n, _, height, width = images.shape
    columns = columns or n
    rows = -(-n // columns)
    canvas = torch.zeros(3, rows * (height + border) + border, columns * (width + border) + border)
    for i, image in enumerate(images.clamp(-1, 1)):
        top, left = border + (i // columns) * (height + border), border + (i % columns) * (width + border)
        canvas[:, top:top + height, left:left + width] = (image + 1) / 2
    return (canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()


@contextmanager
def on_device(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """``model`` on the evaluating device for the block, in host memory between evaluations: the device is
    training's then (`dmd2 plan` counts nothing of the evaluator in the rollout's stages)."""
    model.to(device)
    try:
        yield model
    finally:
        model.to("cpu")


EVAL_PROMPTS_DEFAULT = 4  # the first prompts of [data] prompts make the eval set when [eval] prompts is unset


def eval_prompts(config: DistillConfig) -> list[str]:
    """The eval set's prompts: `[eval] prompts`, else the first of `[data] prompts`."""
    return list(config.eval.prompts) or read_prompts(config.data.prompts)[:EVAL_PROMPTS_DEFAULT]


def eval_batch(config: DistillConfig, share: int, teacher: bool = False) -> int:
    """How many of a rank's ``share`` of the eval set it samples at once (each row from the noise it has in the whole
    evaluation), so that no sampling holds more of a GPU than the training stage that runs the same model does: the
    student at most the GPU's samples of a rollout (K x B, which the rollout runs through it at once), the guided
    teacher at most a critic step's B (as it scores them)."""
    most = config.critic_batch_size if teacher else config.train.rollout_batch_size // config.train.data_ranks
    return max(1, min(share, most))


def planned_eval_batch(config: DistillConfig, teacher: bool = False) -> int:
    """`eval_batch` of the largest share, from the options alone (`dmd2 plan` reads no prompt file): with `[eval]
    prompts` unset, of as many prompts as the set can take."""
    rows = (len(config.eval.prompts) or EVAL_PROMPTS_DEFAULT) * config.eval.samples_per_prompt
    return eval_batch(config, -(-rows // config.train.data_ranks), teacher)


@dataclass
class PromptSetEvaluator:
    """Runs on the evaluating rank's ``device``: the teacher and the decoder are moved there while they work (the
    teacher in its training dtype, `[train] mixed_precision`), and the samplers' small host tensors go to them per
    call. ``cache_dir``: where a built-in judge is cached."""

    family: "object"  # the bound family (its prompt table holds the eval prompts after the training prompts)
    config: DistillConfig
    prompts: list[str]
    first_index: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cache_dir: Path = field(default_factory=default_cache_dir)
    _teacher_samples: dict[str, Tensor] | None = field(default=None, repr=False)
    _reference: dict[str, Tensor] | None = field(default=None, repr=False)  # the reference samples' features
    _vae: object = field(default=None, repr=False)
    # The teacher the rank's process holds already (its critic's, `RankWorker.lend_teacher`), lent for the block.
    lent_teacher: Callable[[], AbstractContextManager[nn.Module]] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, family, config: DistillConfig, device: torch.device | str = "cpu",
              cache_dir: Path | None = None) -> "PromptSetEvaluator":
        return cls(family, config, family.eval_prompts(config), len(read_prompts(config.data.prompts)),
                   torch.device(device), cache_dir or default_cache_dir())

    def prompt_of(self) -> Tensor:
        """The eval prompt of each row of the eval set [P S]: row k P + p is prompt p's sample from noise k."""
        return torch.arange(len(self.prompts) * self.config.eval.samples_per_prompt) % len(self.prompts)

    def conds(self):
        rows = self.prompt_of()
        return prompt_indices(self.first_index + rows), negative_indices(len(rows))

    def _rows(self, rank: int, world_size: int) -> tuple[slice, int]:
        """Rank ``rank``'s window of the eval set's rows and where its own share starts in it. Every window is as long
        as the largest share and so sampled in as many batches: a sharded model's every forward is a collective all
        ranks make. A shorter (or empty) last share is sampled with the rows before it, which its rank drops."""
        count = len(self.prompt_of())
        per_rank = -(-count // world_size)  # rounded up
        start = min(rank * per_rank, count)
        first = min(start + per_rank, count) - per_rank
        return slice(first, first + per_rank), start - first

    @torch.no_grad()
    def student_share(self, student: VelocityFn, rank: int = 0, world_size: int = 1) -> Tensor:
        """The student's latents of rank ``rank``'s share of the eval set, from the noise those rows have in the
        whole evaluation; `score` takes every rank's, in rank order."""
        rows, own = self._rows(rank, world_size)
        cond, neg = self.conds()
        latents = self._in_batches(rows, False, lambda part: generate(
            student, cond, neg, self.latent_shape(), sampler="student", num_steps=self.config.student.num_steps,
            shift=self.config.student.grid_shift, seed=self.config.train.seed, clamp=False, rows=part))
        return latents[own:]

    @torch.no_grad()
    def teacher_share(self, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """The teacher's own latents of rank ``rank``'s share (see `teacher_samples`), with the teacher on this
        evaluator's device in its training dtype for them: lent (`lent_teacher`), or loaded and let go after."""
        rows, own = self._rows(rank, world_size)
        with self._teacher() as model:
            return {name: latents[own:] for name, latents in self._teacher_latents(model, rows).items()}

    def _teacher(self) -> AbstractContextManager[nn.Module]:
        """The teacher on this evaluator's device for the block: `lent_teacher`'s, else one loaded (let go after)."""
        if self.lent_teacher is not None:
            return self.lent_teacher()
        # Loading initialises weights from the global RNG first: keep the caller's RNG untouched.
        with torch.random.fork_rng(devices=[]):
            model = self.family.load_model(self.config.model.teacher, teacher_dtype(self.config))
        return nullcontext(model.to(self.device).eval().requires_grad_(False))

    def _teacher_latents(self, model: nn.Module, rows: slice) -> dict[str, Tensor]:
        teacher = HostCalls(in_run_precision(self.family.velocity(model), self.config, self.device.type), self.device)
        cond, neg = self.conds()
        samples = {}
        seed = self.config.train.seed
        grids = {"reference": (self.config.eval.reference_steps, seed + REFERENCE_SEED_OFFSET),
                 "baseline": (self.config.student.num_steps, seed)}
        for name, (steps, noise_seed) in grids.items():
            latents = self._in_batches(rows, True, lambda part: generate(
                teacher, cond, neg, self.latent_shape(), sampler="teacher", num_steps=steps,
                guidance_scale=self.config.dmd2.teacher_guidance_scale, shift=self.config.student.grid_shift,
                seed=noise_seed, clamp=False, rows=part).cpu())
            samples[name] = latents
        return samples

    def _in_batches(self, rows: slice, teacher: bool, sample: Callable[[slice], Tensor]) -> Tensor:
        """``sample(part)`` of each part of ``rows`` in turn, concatenated: parts of `eval_batch` rows (`dmd2 plan`'s
        evaluate and reference rows)."""
        size = eval_batch(self.config, rows.stop - rows.start, teacher)
        return torch.cat([sample(slice(start, min(start + size, rows.stop)))
                          for start in range(rows.start, rows.stop, size)])

    def teacher_samples(self) -> dict[str, Tensor]:
        """The teacher's own latents: "reference" at `[eval] reference_steps` from noise of its own (what the KIDs
        compare the student's pictures with; the teacher's grid) and "baseline" at the student's step count from the
        student's noise.
        Made here at the first need unless handed in (`with_references`: made by the ranks' shares, or earlier in
        the run)."""
        if self._teacher_samples is None:
            self._teacher_samples = self.teacher_share()
        return self._teacher_samples

    def has_references(self) -> bool:
        return self._teacher_samples is not None

    def references_id(self) -> str:
        """Names what `teacher_samples` depend on (the teacher, the prompts and their noises, the grids, the seed,
        the precision), so that ones stored for another setting are never handed in."""
        config = self.config
        settings = [config.model.teacher, self.prompts, config.eval.reference_steps, config.student.num_steps,
                    config.student.grid_shift, config.dmd2.teacher_guidance_scale, config.train.seed,
                    config.data.resolution, config.train.mixed_precision, config.eval.samples_per_prompt,
                    REFERENCE_SEED_OFFSET]
        return "teacher-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def references(self) -> dict[str, Tensor]:
        """What this evaluator makes once per run, for the rank to store (`teacher_samples`)."""
        return self.teacher_samples()

    def with_references(self, tensors: dict[str, Tensor]) -> None:
        """Hand in `references` made earlier in the run (by a rank since replaced): the teacher is not loaded."""
        if set(tensors) != {"reference", "baseline"}:
            raise ValueError(f"SD3 references hold 'reference' and 'baseline', got {sorted(tensors)}")
        self._teacher_samples, self._reference = dict(tensors), None

    def _reference_spaces(self) -> dict[str, Tensor]:
        if self._reference is None:  # decoded and judged once per evaluator: the reference never changes
            self._reference = self._spaces(self.decode(self.teacher_samples()["reference"]))
        return self._reference

    @torch.no_grad()
    def evaluate(self, student: VelocityFn) -> Evaluation:
        return self.score(self.student_share(student))

    @torch.no_grad()
    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """The teacher at the student's step count from the same noise: the naive few-step baseline."""
        steps, guidance = self.config.student.num_steps, self.config.dmd2.teacher_guidance_scale
        scores, _ = self._scores(self.teacher_samples()["baseline"])
        return [(f"teacher, {steps} steps, guidance {guidance:g}", scores)]


    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def decode(self, latents: Tensor) -> Tensor:
        raise NotImplementedError

    def _spaces(self, pixels: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        raise NotImplementedError

    def score(self, latents: Tensor) -> Evaluation:
        raise NotImplementedError

    def reference_media(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

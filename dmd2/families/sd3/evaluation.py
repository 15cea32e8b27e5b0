"""The SD3 family's evaluation: how close the student's samples are, as a distribution, to the teacher's many-step
ones, how varied they are, and a grid of them.

The eval set is the eval prompts, each sampled from `[eval] samples_per_prompt` noises (row k P + p: prompt p of P,
noise k), the same seeded noise every evaluation, so that grids of successive evaluations compare picture by
picture. Scores, each of the decoded pictures (docs/architecture.md, "The SD3 evaluation"):

- `eval/pixel_kid_teacher`: KID (dmd2/metrics.py) between the student's pictures and the teacher's reference ones
  (`[eval] reference_steps` guided Euler steps from noise of their own) on pixels area-downsampled to 32 x 32: the
  model-free judge, always reported;
- `eval/kid_teacher`: the same KID in `[eval] feature_model`'s features, when one is set;
- `eval/distance_teacher`: the gate (`SD3Family.gate_metric`), the feature KID when a feature model is set, else the
  pixel KID;
- `eval/diversity`: the mean over prompts of the mean distance between a prompt's samples (in the feature model's
  space, else pixels), and `eval/diversity_ratio`, it over the teacher's reference samples' own: ~1 healthy, ~0 for
  a collapsed student (the same picture from every noise);
- `eval/clip_score` with `[eval] clip_model`; `eval/prompt_accuracy` with a judge that reads digits
  (`builtin:digits`): the fraction of samples read as the digit their prompt names.

Distances between sets, not the latent distance to the teacher's sample of the same noise: DMD matches the
teacher's distribution, not its trajectories, so a good student may draw another good picture from that noise.

Every model runs on the evaluating rank's device. The teacher is loaded once per evaluator for its two sets of
samples (`teacher_samples`), which the rank stores and hands to the evaluator of a later rank process of the same
run (`references`, `with_references`), so a run samples the teacher's many-step reference once.
"""

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dmd2.config import DistillConfig
from dmd2.family import Evaluation, default_cache_dir
from dmd2.families.sd3.conditioning import negative_indices, prompt_indices
from dmd2.families.sd3.judges import ClipScorer, Judge, load_judge, on_device
from dmd2.families.sd3.prompts import read_prompts
from dmd2.metrics import diversity, kid_to_reference, pixel_features
from dmd2.model import HostCalls, VelocityFn
from dmd2.precision import in_run_precision, teacher_dtype
from dmd2.sample import generate

# The gate's name whichever judge measured it: the family names its gate metric once (a class attribute the
# registry reads without the run's config), so the evaluator puts the recipe's chosen distance under this name.
# The registry compares it across the versions of one registered model: their runs should share `[eval]
# feature_model`.
DISTANCE = "eval/distance_teacher"
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


@dataclass
class SD3Evaluator:
    """Runs on the evaluating rank's ``device``: the teacher, the VAE and the judges' models are moved there while
    they work (the teacher in its training dtype, `[train] mixed_precision`), and the samplers' small host tensors
    go to them per call. ``cache_dir``: where a built-in feature model is cached (`builtin:digits`)."""

    family: "object"  # the bound SD3Family (its table holds the eval prompts after the training prompts)
    config: DistillConfig
    prompts: list[str]
    first_index: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cache_dir: Path = field(default_factory=default_cache_dir)
    _teacher_samples: dict[str, Tensor] | None = field(default=None, repr=False)
    _reference: dict[str, Tensor] | None = field(default=None, repr=False)  # the reference pictures' features
    _vae: object = field(default=None, repr=False)
    _judge: Judge | None = field(default=None, repr=False)
    _clip: ClipScorer | None = field(default=None, repr=False)

    @classmethod
    def build(cls, family, config: DistillConfig, device: torch.device | str = "cpu",
              cache_dir: Path | None = None) -> "SD3Evaluator":
        return cls(family, config, family.eval_prompts(config), len(read_prompts(config.data.prompts)),
                   torch.device(device), cache_dir or default_cache_dir())

    def prompt_of(self) -> Tensor:
        """The eval prompt of each row of the eval set [P S]: row k P + p is prompt p's sample from noise k."""
        return torch.arange(len(self.prompts) * self.config.eval.samples_per_prompt) % len(self.prompts)

    def conds(self):
        rows = self.prompt_of()
        return prompt_indices(self.first_index + rows), negative_indices(len(rows))

    def latent_shape(self):
        from dmd2.families.sd3.pipeline import latent_shape

        return latent_shape(self.config.model.teacher, self.config.data.resolution)

    def _rows(self, rank: int, world_size: int) -> tuple[slice, bool]:
        """Rank ``rank``'s share of the eval set's rows (equal shares, the last ones shorter), and whether it keeps
        what it samples: a rank left without a row samples the last one and drops it, since a sharded model's
        every forward is a collective all ranks make."""
        count = len(self.prompt_of())
        per_rank = -(-count // world_size)  # rounded up
        start = rank * per_rank
        if start >= count:
            return slice(count - 1, count), False
        return slice(start, min(start + per_rank, count)), True

    @torch.no_grad()
    def student_share(self, student: VelocityFn, rank: int = 0, world_size: int = 1) -> Tensor:
        """The student's latents of rank ``rank``'s share of the eval set, from the noise those rows have in the
        whole evaluation; `score` takes every rank's, in rank order."""
        rows, kept = self._rows(rank, world_size)
        cond, neg = self.conds()
        latents = generate(student, cond, neg, self.latent_shape(), sampler="student",
                           num_steps=self.config.student.num_steps, shift=self.config.student.grid_shift,
                           seed=self.config.train.seed, clamp=False, rows=rows)
        return latents if kept else latents[:0]

    @torch.no_grad()
    def teacher_share(self, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """The teacher's own latents of rank ``rank``'s share (see `teacher_samples`), with one load of the
        teacher on this evaluator's device in its training dtype, let go after."""
        rows, kept = self._rows(rank, world_size)
        # Loading initialises weights from the global RNG first: keep the caller's RNG untouched.
        with torch.random.fork_rng(devices=[]):
            model = self.family.load_model(self.config.model.teacher, teacher_dtype(self.config))
        model = model.to(self.device).eval().requires_grad_(False)
        teacher = HostCalls(in_run_precision(self.family.velocity(model), self.config, self.device.type), self.device)
        cond, neg = self.conds()
        samples = {}
        seed = self.config.train.seed
        grids = {"reference": (self.config.eval.reference_steps, seed + REFERENCE_SEED_OFFSET),
                 "baseline": (self.config.student.num_steps, seed)}
        for name, (steps, noise_seed) in grids.items():
            latents = generate(teacher, cond, neg, self.latent_shape(), sampler="teacher", num_steps=steps,
                               guidance_scale=self.config.dmd2.teacher_guidance_scale,
                               shift=self.config.student.grid_shift, seed=noise_seed, clamp=False, rows=rows)
            samples[name] = latents.cpu() if kept else latents[:0].cpu()
        return samples

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

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [N, 3, H, W] in [-1, 1], as StableDiffusion3Pipeline decodes them."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            self._vae = AutoencoderKL.from_pretrained(self.config.model.teacher, subfolder="vae",
                                                      low_cpu_mem_usage=False, use_safetensors=True).eval()
        with on_device(self._vae, self.device) as vae:
            return torch.cat([vae.decode(chunk.to(self.device) / vae.config.scaling_factor + vae.config.shift_factor,
                                         return_dict=False)[0].cpu() for chunk in latents.split(DECODE_BATCH)])

    def judge(self) -> Judge | None:
        """`[eval] feature_model`, loaded at the first need; None when unset."""
        if self._judge is None and self.config.eval.feature_model:
            self._judge = load_judge(self.config.eval.feature_model, self.cache_dir, self.device)
        return self._judge

    def clip_score(self, images: Tensor) -> float:
        """The mean CLIP score of the eval set's pictures against their prompts, with `[eval] clip_model`."""
        if self._clip is None:
            self._clip = ClipScorer.load(self.config.eval.clip_model, self.device)
        return self._clip(images, self.prompts, self.prompt_of())

    def _spaces(self, images: Tensor) -> dict[str, Tensor]:
        """The pictures' features for each judge: "pixels" always, "features" with a feature model."""
        spaces = {"pixels": pixel_features(images)}
        if (judge := self.judge()) is not None:
            spaces["features"] = judge.features(images)
        return spaces

    def _reference_spaces(self) -> dict[str, Tensor]:
        if self._reference is None:  # decoded and judged once per evaluator: the reference never changes
            self._reference = self._spaces(self.decode(self.teacher_samples()["reference"]))
        return self._reference

    def prompt_accuracy(self, images: Tensor) -> float | None:
        """The fraction of the eval set's pictures whose prompt names a digit that the judge reads as that digit;
        None unless the judge reads digits (`builtin:digits`) and some prompt names one."""
        judge = self.judge()
        if not hasattr(judge, "classify"):
            return None
        from dmd2.families.sd3.builtin.captions import digit_of

        named = torch.tensor([-1 if digit_of(prompt) is None else digit_of(prompt) for prompt in self.prompts])
        digits = named[self.prompt_of()]
        if not (digits >= 0).any():
            return None
        return (judge.classify(images[digits >= 0]) == digits[digits >= 0]).double().mean().item()

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        images = self.decode(latents)
        spaces, reference, prompt_of = self._spaces(images), self._reference_spaces(), self.prompt_of()
        strata = (prompt_of, prompt_of)  # both sets hold each prompt samples_per_prompt times
        scores = {"eval/pixel_kid_teacher": kid_to_reference(spaces["pixels"], reference["pixels"], strata)}
        if "features" in spaces:
            scores["eval/kid_teacher"] = kid_to_reference(spaces["features"], reference["features"], strata)
        scores[DISTANCE] = scores.get("eval/kid_teacher", scores["eval/pixel_kid_teacher"])
        space = "features" if "features" in spaces else "pixels"
        spread, teacher_spread = diversity(spaces[space], prompt_of), diversity(reference[space], prompt_of)
        scores["eval/diversity"] = spread
        scores["eval/diversity_ratio"] = spread / teacher_spread if teacher_spread > 0 else math.nan
        if self.config.eval.clip_model:
            scores["eval/clip_score"] = self.clip_score(images)
        if (accuracy := self.prompt_accuracy(images)) is not None:
            scores["eval/prompt_accuracy"] = accuracy
        return scores, images

    @torch.no_grad()
    def evaluate(self, student: VelocityFn) -> Evaluation:
        return self.score(self.student_share(student))

    @torch.no_grad()
    def score(self, latents: Tensor) -> Evaluation:
        """The scores and grid (a row per noise, a column per prompt) of the student's latents of the whole eval
        set (`student_share`s, in rank order)."""
        scores, images = self._scores(latents)
        return Evaluation(scores, {"samples": image_grid(images, len(self.prompts))})

    @torch.no_grad()
    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """The teacher at the student's step count from the same noise: the naive few-step baseline."""
        steps, guidance = self.config.student.num_steps, self.config.dmd2.teacher_guidance_scale
        scores, _ = self._scores(self.teacher_samples()["baseline"])
        return [(f"teacher, {steps} steps, guidance {guidance:g}", scores)]

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": image_grid(self.decode(self.teacher_samples()["reference"]), len(self.prompts))}

"""The SD3 family's evaluation: the student's samples of the eval prompts, decoded into one grid.

Every evaluation uses the same noise (seeded), so grids of successive evaluations compare picture by
picture. Scores: `eval/latent_mse_teacher`, the mean squared distance of the student's latents to the
teacher's own many-step guided latents from the same noise (fidelity: lower is closer to the teacher),
and with `[eval] clip_model` the mean CLIP score (100 * cosine of image and prompt embeddings, at
least 0; Hessel et al. 2021). The teacher's grid of the same prompts is the reference media.

Every model runs on the evaluating rank's device. The teacher is loaded once per evaluator for its two sets of
samples (`teacher_samples`), which the rank stores and hands to the evaluator of a later rank process of the same
run (`references`, `with_references`), so a run samples the teacher's many-step reference once.
"""

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dmd2.config import DistillConfig
from dmd2.family import Evaluation
from dmd2.families.sd3.conditioning import negative_indices, prompt_indices
from dmd2.families.sd3.prompts import read_prompts
from dmd2.model import HostCalls, VelocityFn
from dmd2.precision import in_run_precision, teacher_dtype
from dmd2.sample import generate


def image_grid(images: Tensor, border: int = 2) -> np.ndarray:
    """Images [N, 3, H, W] in [-1, 1] side by side as one uint8 picture [H + 2b, N (W + b) + b, 3]."""
    n, _, height, width = images.shape
    canvas = torch.zeros(3, height + 2 * border, n * (width + border) + border)
    for i, image in enumerate(images.clamp(-1, 1)):
        left = border + i * (width + border)
        canvas[:, border:border + height, left:left + width] = (image + 1) / 2
    return (canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()


def _features(output) -> Tensor:
    """CLIP's projected embeddings: transformers 5 returns them as the output's `pooler_output`."""
    return output if isinstance(output, Tensor) else output.pooler_output


@dataclass
class SD3Evaluator:
    """Runs on the evaluating rank's ``device``: the teacher, the VAE and CLIP are moved there while they work (the
    teacher in its training dtype, `[train] mixed_precision`), and the samplers' small host tensors go to them per
    call."""

    family: "object"  # the bound SD3Family (its table holds the eval prompts after the training prompts)
    config: DistillConfig
    prompts: list[str]
    first_index: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _teacher_samples: dict[str, Tensor] | None = field(default=None, repr=False)
    _vae: object = field(default=None, repr=False)
    _clip: tuple | None = field(default=None, repr=False)

    @classmethod
    def build(cls, family, config: DistillConfig, device: torch.device | str = "cpu") -> "SD3Evaluator":
        return cls(family, config, family.eval_prompts(config), len(read_prompts(config.data.prompts)),
                   torch.device(device))

    def _conds(self):
        index = torch.arange(self.first_index, self.first_index + len(self.prompts))
        return prompt_indices(index), negative_indices(len(self.prompts))

    def _shape(self):
        from dmd2.families.sd3.pipeline import latent_shape

        return latent_shape(self.config.model.teacher, self.config.data.resolution)

    def _rows(self, rank: int, world_size: int) -> tuple[slice, bool]:
        """Rank ``rank``'s share of the eval prompts (equal shares, the last ones shorter), and whether it keeps
        what it samples: a rank left without a prompt samples the last one and drops it, since a sharded
        model's every forward is a collective all ranks make."""
        count = len(self.prompts)
        per_rank = -(-count // world_size)  # rounded up
        start = rank * per_rank
        if start >= count:
            return slice(count - 1, count), False
        return slice(start, min(start + per_rank, count)), True

    @torch.no_grad()
    def student_share(self, student: VelocityFn, rank: int = 0, world_size: int = 1) -> Tensor:
        """The student's latents of rank ``rank``'s share of the eval prompts, from the noise those prompts have
        in the whole evaluation; `score` takes every rank's, in rank order."""
        rows, kept = self._rows(rank, world_size)
        cond, neg = self._conds()
        latents = generate(student, cond, neg, self._shape(), sampler="student",
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
        cond, neg = self._conds()
        samples = {}
        grids = {"reference": self.config.eval.reference_steps, "baseline": self.config.student.num_steps}
        for name, steps in grids.items():
            latents = generate(teacher, cond, neg, self._shape(), sampler="teacher", num_steps=steps,
                               guidance_scale=self.config.dmd2.teacher_guidance_scale,
                               shift=self.config.student.grid_shift, seed=self.config.train.seed, clamp=False,
                               rows=rows)
            samples[name] = latents.cpu() if kept else latents[:0].cpu()
        return samples

    def teacher_samples(self) -> dict[str, Tensor]:
        """The teacher's own latents from the student's noise: "reference" at `[eval] reference_steps` (what
        `eval/latent_mse_teacher` measures against; the teacher's grid) and "baseline" at the student's step
        count. Made here at the first need unless handed in (`with_references`: made by the ranks' shares, or
        earlier in the run)."""
        if self._teacher_samples is None:
            self._teacher_samples = self.teacher_share()
        return self._teacher_samples

    def has_references(self) -> bool:
        return self._teacher_samples is not None

    def references_id(self) -> str:
        """Names what `teacher_samples` depend on (the teacher, the prompts, the grids, the seed, the precision),
        so that ones stored for another setting are never handed in."""
        config = self.config
        settings = [config.model.teacher, self.prompts, config.eval.reference_steps, config.student.num_steps,
                    config.student.grid_shift, config.dmd2.teacher_guidance_scale, config.train.seed,
                    config.data.resolution, config.train.mixed_precision]
        return "teacher-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def references(self) -> dict[str, Tensor]:
        """What this evaluator makes once per run, for the rank to store (`teacher_samples`)."""
        return self.teacher_samples()

    def with_references(self, tensors: dict[str, Tensor]) -> None:
        """Hand in `references` made earlier in the run (by a rank since replaced): the teacher is not loaded."""
        if set(tensors) != {"reference", "baseline"}:
            raise ValueError(f"SD3 references hold 'reference' and 'baseline', got {sorted(tensors)}")
        self._teacher_samples = dict(tensors)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [N, 3, H, W] in [-1, 1], as StableDiffusion3Pipeline decodes them."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            self._vae = AutoencoderKL.from_pretrained(self.config.model.teacher, subfolder="vae",
                                                      low_cpu_mem_usage=False, use_safetensors=True).eval()
        with self._on_device(self._vae) as vae:
            latents = latents.to(self.device) / vae.config.scaling_factor + vae.config.shift_factor
            return vae.decode(latents, return_dict=False)[0].cpu()

    @torch.no_grad()
    def clip_score(self, images: Tensor) -> float:
        """Mean of max(100 cos(image, prompt), 0) over the eval prompts, with `[eval] clip_model`."""
        from transformers import AutoTokenizer, CLIPModel

        if self._clip is None:
            path = self.config.eval.clip_model
            self._clip = (CLIPModel.from_pretrained(path, use_safetensors=True).eval(),
                          AutoTokenizer.from_pretrained(path))
        model, tokenizer = self._clip
        size = model.config.vision_config.image_size
        pixels = torch.nn.functional.interpolate((images.clamp(-1, 1) + 1) / 2, size=(size, size), mode="bicubic")
        mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)  # CLIP's preprocessing
        std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
        tokens = tokenizer(self.prompts, padding=True, truncation=True, return_tensors="pt").to(self.device)
        with self._on_device(model):
            image = _features(model.get_image_features(pixel_values=((pixels - mean) / std).to(self.device)))
            text = _features(model.get_text_features(**tokens))
        cosine = torch.nn.functional.cosine_similarity(image, text)
        return (100 * cosine).clamp(min=0).mean().item()

    @contextmanager
    def _on_device(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` on the evaluating device for the block, in host memory between evaluations: the device is
        training's then (`dmd2 plan` counts nothing of the evaluator in the rollout's stages)."""
        model.to(self.device)
        try:
            yield model
        finally:
            model.to("cpu")

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        images = self.decode(latents)
        scores = {"eval/latent_mse_teacher": (latents - self.teacher_samples()["reference"]).pow(2).mean().item()}
        if self.config.eval.clip_model:
            scores["eval/clip_score"] = self.clip_score(images)
        return scores, images

    @torch.no_grad()
    def evaluate(self, student: VelocityFn) -> Evaluation:
        return self.score(self.student_share(student))

    @torch.no_grad()
    def score(self, latents: Tensor) -> Evaluation:
        """The scores and grid of the student's latents of every eval prompt (`student_share`s, in rank order)."""
        scores, images = self._scores(latents)
        return Evaluation(scores, {"samples": image_grid(images)})

    @torch.no_grad()
    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """The teacher at the student's step count from the same noise: the naive few-step baseline."""
        steps, guidance = self.config.student.num_steps, self.config.dmd2.teacher_guidance_scale
        scores, _ = self._scores(self.teacher_samples()["baseline"])
        return [(f"teacher, {steps} steps, guidance {guidance:g}", scores)]

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": image_grid(self.decode(self.teacher_samples()["reference"]))}


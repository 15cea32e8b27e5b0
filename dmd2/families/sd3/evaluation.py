"""The SD3 family's evaluation: the student's samples of the eval prompts, decoded into one grid.

Every evaluation uses the same noise (seeded), so grids of successive evaluations compare picture by
picture. Scores: `eval/latent_mse_teacher`, the mean squared distance of the student's latents to the
teacher's own many-step guided latents from the same noise (fidelity: lower is closer to the teacher),
and with `[eval] clip_model` the mean CLIP score (100 * cosine of image and prompt embeddings, at
least 0; Hessel et al. 2021). The teacher's grid of the same prompts is the reference media.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dmd2.config import DistillConfig
from dmd2.family import Evaluation
from dmd2.families.sd3.conditioning import negative_indices, prompt_indices
from dmd2.families.sd3.prompts import read_prompts
from dmd2.model import VelocityFn
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
    family: "object"  # the bound SD3Family (its table holds the eval prompts after the training prompts)
    config: DistillConfig
    prompts: list[str]
    first_index: int
    _teacher_latents: Tensor | None = field(default=None, repr=False)
    _vae: object = field(default=None, repr=False)
    _clip: tuple | None = field(default=None, repr=False)

    @classmethod
    def build(cls, family, config: DistillConfig) -> "SD3Evaluator":
        return cls(family, config, family.eval_prompts(config), len(read_prompts(config.data.prompts)))

    def _conds(self):
        index = torch.arange(self.first_index, self.first_index + len(self.prompts))
        return prompt_indices(index), negative_indices(len(self.prompts))

    def _shape(self):
        from dmd2.families.sd3.pipeline import latent_shape

        return latent_shape(self.config.model.teacher, self.config.data.resolution)

    def _student_latents(self, student: VelocityFn) -> Tensor:
        cond, neg = self._conds()
        return generate(student, cond, neg, self._shape(), sampler="student", num_steps=self.config.student.num_steps,
                        shift=self.config.student.grid_shift, seed=self.config.train.seed, clamp=False)

    def _teacher(self) -> VelocityFn:
        # Loading initialises weights from the global RNG first: keep the caller's RNG untouched.
        with torch.random.fork_rng(devices=[]):
            model = self.family.load_model(self.config.model.teacher).eval().requires_grad_(False)
        return self.family.velocity(model)

    def teacher_latents(self, num_steps: int | None = None) -> Tensor:
        cond, neg = self._conds()
        steps = num_steps or self.config.eval.reference_steps
        return generate(self._teacher(), cond, neg, self._shape(), sampler="teacher", num_steps=steps,
                        guidance_scale=self.config.dmd2.teacher_guidance_scale, shift=self.config.student.grid_shift,
                        seed=self.config.train.seed, clamp=False)

    def _reference(self) -> Tensor:
        if self._teacher_latents is None:  # the teacher's own many-step samples, from the student's noise
            self._teacher_latents = self.teacher_latents()
        return self._teacher_latents

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [N, 3, H, W] in [-1, 1], as StableDiffusion3Pipeline decodes them."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            self._vae = AutoencoderKL.from_pretrained(self.config.model.teacher, subfolder="vae",
                                                      low_cpu_mem_usage=False, use_safetensors=True).eval()
        vae = self._vae
        return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]

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
        image = _features(model.get_image_features(pixel_values=(pixels - mean) / std))
        tokens = tokenizer(self.prompts, padding=True, truncation=True, return_tensors="pt")
        text = _features(model.get_text_features(**tokens))
        cosine = torch.nn.functional.cosine_similarity(image, text)
        return (100 * cosine).clamp(min=0).mean().item()

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        images = self.decode(latents)
        scores = {"eval/latent_mse_teacher": (latents - self._reference()).pow(2).mean().item()}
        if self.config.eval.clip_model:
            scores["eval/clip_score"] = self.clip_score(images)
        return scores, images

    @torch.no_grad()
    def evaluate(self, student: VelocityFn) -> Evaluation:
        scores, images = self._scores(self._student_latents(student))
        return Evaluation(scores, {"samples": image_grid(images)})

    @torch.no_grad()
    def baselines(self) -> list[tuple[str, dict[str, float]]]:
        """The teacher at the student's step count from the same noise: the naive few-step baseline."""
        steps, guidance = self.config.student.num_steps, self.config.dmd2.teacher_guidance_scale
        scores, _ = self._scores(self.teacher_latents(steps))
        return [(f"teacher, {steps} steps, guidance {guidance:g}", scores)]

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": image_grid(self.decode(self._reference()))}


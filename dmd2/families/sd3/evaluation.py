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

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dmd2.eval_set import DECODE_BATCH, REFERENCE_SEED_OFFSET, PromptSetEvaluator, image_grid  # noqa: F401
from dmd2.family import Evaluation
from dmd2.families.sd3.judges import ClipScorer, Judge, load_judge, on_device
from dmd2.metrics import diversity, kid_to_reference, pixel_features

# The gate's name whichever judge measured it: the family names its gate metric once (a class attribute the
# registry reads without the run's config), so the evaluator puts the recipe's chosen distance under this name.
# The registry compares it across the versions of one registered model: their runs should share `[eval]
# feature_model`.
DISTANCE = "eval/distance_teacher"


@dataclass
class SD3Evaluator(PromptSetEvaluator):
    """SD3's pictures: decoded by the pipeline's VAE, judged on pixels and by `[eval] feature_model` (and CLIP)."""

    _judge: Judge | None = field(default=None, repr=False)
    _clip: ClipScorer | None = field(default=None, repr=False)

    def latent_shape(self):
        from dmd2.families.sd3.pipeline import latent_shape

        return latent_shape(self.config.model.teacher, self.config.data.resolution)

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
    def score(self, latents: Tensor) -> Evaluation:
        """The scores and grid (a row per noise, a column per prompt) of the student's latents of the whole eval
        set (`student_share`s, in rank order)."""
        scores, images = self._scores(latents)
        return Evaluation(scores, {"samples": image_grid(images, len(self.prompts))})

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": image_grid(self.decode(self.teacher_samples()["reference"]), len(self.prompts))}

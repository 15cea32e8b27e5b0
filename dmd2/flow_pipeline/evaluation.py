"""The evaluation of a text-to-image pipeline family: how close the student's pictures are, as a distribution, to the
teacher's many-step ones, how varied they are, and a grid of them (docs/architecture.md, "The SD3 evaluation").

The prompt-set evaluation (dmd2/eval_set.py: the eval set of prompts x noises, the teacher's reference made once per
run and split over the ranks) on pictures decoded by the pipeline's VAE as the pipeline decodes them (the family's
`decode_latents`). Scores:

- `eval/pixel_kid_teacher`: KID (dmd2/metrics.py) between the student's pictures and the teacher's reference ones
  on pixels area-downsampled to 32 x 32: the model-free judge, always reported;
- `eval/kid_teacher`: the same KID in `[eval] feature_model`'s features, when one is set;
- `eval/pixel_kid_teacher_se`, `eval/kid_teacher_se`: their standard errors, from the spread of KIDs over disjoint
  sets of the eval set's noises (with at least 4 noises per prompt);
- `eval/distance_teacher` (and `_se`): the gate, the feature KID when a feature model is set, else the pixel KID;
- `eval/diversity`: the mean over prompts of the mean distance between a prompt's samples (in the feature model's
  space, else pixels), and `eval/diversity_ratio`, it over the teacher's reference samples' own: ~1 healthy, ~0 for
  a collapsed student (the same picture from every noise);
- `eval/clip_score` with `[eval] clip_model`; and what the family adds (`extra_scores`).

Distances between sets, not the latent distance to the teacher's sample of the same noise: DMD matches the
teacher's distribution, not its trajectories, so a good student may draw another good picture from that noise.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from dmd2.eval_set import DECODE_BATCH, PromptSetEvaluator, image_grid, on_device
from dmd2.family import Evaluation
from dmd2.flow_pipeline.judges import ClipScorer, Judge, load_judge
from dmd2.metrics import diversity, kid_standard_error, kid_to_reference, pixel_features

# The gate's name whichever judge measured it: the family names its gate metric once (a class attribute the
# registry reads without the run's config), so the evaluator puts the recipe's chosen distance under this name.
DISTANCE = "eval/distance_teacher"


def kid_scores(key: str, x: Tensor, reference: Tensor, strata: tuple[Tensor, Tensor]) -> dict[str, float]:
    """``key``: the KID of ``x`` to ``reference``; ``key``_se: its standard error (`kid_standard_error`), left out
    when the eval set holds too few samples of a prompt to estimate it (under 4)."""
    scores = {key: kid_to_reference(x, reference, strata)}
    if not math.isnan(error := kid_standard_error(x, reference, strata)):
        scores[f"{key}_se"] = error
    return scores


def gate_scores(scores: dict[str, float], key: str) -> dict[str, float]:
    """The score ``key``, and its standard error if it has one, again under the gate's name (`DISTANCE`): the
    registry moves the champion only by more than the noise of both versions' figures."""
    return {DISTANCE + suffix: scores[key + suffix] for suffix in ("", "_se") if key + suffix in scores}


@dataclass
class PictureEvaluator(PromptSetEvaluator):
    """Pictures decoded by the pipeline's VAE, judged on pixels and by `[eval] feature_model` (and CLIP)."""

    _judge: Judge | None = field(default=None, repr=False)
    _clip: ClipScorer | None = field(default=None, repr=False)

    def latent_shape(self):
        return self.family.sample_shape(self.config.model.teacher, self.config)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images [N, 3, H, W] in [-1, 1], as the pipeline decodes them."""
        if self._vae is None:
            self._vae = self.family.load_vae(self.config.model.teacher).eval()
        with on_device(self._vae, self.device) as vae:
            return torch.cat([self.family.decode_latents(vae, chunk.to(self.device)).cpu()
                              for chunk in latents.split(DECODE_BATCH)])

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

    def extra_scores(self, images: Tensor) -> dict[str, float]:
        """A family's own scores of the eval set's pictures (none here)."""
        return {}

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        images = self.decode(latents)
        spaces, reference, prompt_of = self._spaces(images), self._reference_spaces(), self.prompt_of()
        strata = (prompt_of, prompt_of)  # both sets hold each prompt samples_per_prompt times
        scores = kid_scores("eval/pixel_kid_teacher", spaces["pixels"], reference["pixels"], strata)
        if "features" in spaces:
            scores |= kid_scores("eval/kid_teacher", spaces["features"], reference["features"], strata)
        space = "features" if "features" in spaces else "pixels"  # the gate's judge, and diversity's
        scores |= gate_scores(scores, {"features": "eval/kid_teacher", "pixels": "eval/pixel_kid_teacher"}[space])
        spread, teacher_spread = diversity(spaces[space], prompt_of), diversity(reference[space], prompt_of)
        scores["eval/diversity"] = spread
        scores["eval/diversity_ratio"] = spread / teacher_spread if teacher_spread > 0 else math.nan
        if self.config.eval.clip_model:
            scores["eval/clip_score"] = self.clip_score(images)
        return scores | self.extra_scores(images), images

    @torch.no_grad()
    def score(self, latents: Tensor) -> Evaluation:
        """The scores and grid (a row per noise, a column per prompt) of the student's latents of the whole eval
        set (`student_share`s, in rank order)."""
        scores, images = self._scores(latents)
        return Evaluation(scores, {"samples": image_grid(images, len(self.prompts))})

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": image_grid(self.decode(self.teacher_samples()["reference"]), len(self.prompts))}

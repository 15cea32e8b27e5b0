"""The Wan family's evaluation: the student's videos of `[eval] prompts` beside the teacher's, their distance as a
distribution, their diversity, and their motion.

The prompt-set evaluation (dmd2/eval_set.py: the eval set of prompts x noises, the teacher's
reference made once per run and split over the ranks, KID to it, diversity and its ratio), on videos:

- `eval/pixel_kid_teacher` (= `eval/distance_teacher`, the gate): KID between the student's videos and the teacher's
  reference ones, on the frames of a strip (up to 8, evenly spaced) area-downsampled to 32 x 32, concatenated;
  `eval/pixel_kid_teacher_se` its standard error (`dmd2.flow_pipeline.evaluation.kid_scores`);
- `eval/diversity`, `eval/diversity_ratio`: on the same features;
- `eval/motion`: the mean absolute change between consecutive frames (pixels in [-1, 1]), and `eval/motion_ratio`,
  it over the teacher's reference videos' own: ~1 healthy, ~0 for a student that freezes motion (a still video
  can score a fair KID on few frames; it cannot hide here).

Media: `samples`, a video of the eval set's videos side by side (a row per noise, a column per prompt), and the
teacher's reference the same way (`teacher`): the driver logs each as an mp4 and a strip of frames.
"""

import hashlib
import json
import math

import numpy as np
import torch
from torch import Tensor

from dmd2.eval_set import DECODE_BATCH, PromptSetEvaluator, image_grid, on_device
from dmd2.family import Evaluation
from dmd2.media import strip_frames
from dmd2.flow_pipeline.evaluation import gate_scores, kid_scores
from dmd2.metrics import diversity, pixel_features

MOTION = "eval/motion"


def video_features(videos: Tensor) -> Tensor:
    """The model-free judge's features of videos [N, 3, F, H, W]: the strip's frames' `pixel_features`, concatenated."""
    frames = videos[:, :, strip_frames(videos.shape[2])]
    return torch.cat([pixel_features(frames[:, :, i]) for i in range(frames.shape[2])], dim=1)


def motion(videos: Tensor) -> float:
    """The mean absolute change between consecutive frames of videos [N, 3, F, H, W] (0 for stills or one frame)."""
    if videos.shape[2] < 2:
        return 0.0
    return (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean().item()


def video_grid(videos: Tensor, columns: int) -> np.ndarray:
    """Videos [N, 3, F, H, W] in [-1, 1] side by side, frame by frame (`image_grid`'s layout): uint8 [F, H', W', 3]."""
    return np.stack([image_grid(videos[:, :, f], columns) for f in range(videos.shape[2])])


class WanEvaluator(PromptSetEvaluator):
    """The shared prompt-set evaluation on videos: Wan's latents, its VAE, the pixel KID, diversity and motion."""

    def latent_shape(self):
        from dmd2.families.wan.pipeline import latent_shape, video_size

        return latent_shape(self.config.model.teacher, *video_size(self.config.data))

    def references_id(self) -> str:
        from dmd2.families.wan.pipeline import video_size

        settings = [super().references_id(), video_size(self.config.data), self.config.data.max_sequence_length]
        return "teacher-" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Normalised latents [N, C, f, h, w] -> videos [N, 3, F, H, W] in [-1, 1], as WanPipeline decodes them:
        z = latents * latents_std + latents_mean per channel, then the VAE."""
        if self._vae is None:
            from diffusers import AutoencoderKLWan

            self._vae = AutoencoderKLWan.from_pretrained(self.config.model.teacher, subfolder="vae",
                                                         use_safetensors=True).eval()
        with on_device(self._vae, self.device) as vae:
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(self.device)
            std = torch.tensor(vae.config.latents_std).view(shape).to(self.device)
            return torch.cat([vae.decode(chunk.to(self.device) * std + mean, return_dict=False)[0].clamp(-1, 1).cpu()
                              for chunk in latents.split(DECODE_BATCH)])

    def _spaces(self, videos: Tensor) -> dict[str, Tensor]:
        return {"pixels": video_features(videos), "motion": torch.tensor(motion(videos))}

    def _scores(self, latents: Tensor) -> tuple[dict[str, float], Tensor]:
        videos = self.decode(latents)
        spaces, reference, prompt_of = self._spaces(videos), self._reference_spaces(), self.prompt_of()
        kids = kid_scores("eval/pixel_kid_teacher", spaces["pixels"], reference["pixels"], (prompt_of, prompt_of))
        spread, teacher_spread = diversity(spaces["pixels"], prompt_of), diversity(reference["pixels"], prompt_of)
        moving, teacher_motion = motion(videos), reference["motion"].item()
        scores = kids | gate_scores(kids, "eval/pixel_kid_teacher")  # the one judge of videos here is the gate
        scores |= {"eval/diversity": spread,
                   "eval/diversity_ratio": spread / teacher_spread if teacher_spread > 0 else math.nan,
                   MOTION: moving, "eval/motion_ratio": moving / teacher_motion if teacher_motion > 0 else math.nan}
        return scores, videos

    @torch.no_grad()
    def score(self, latents: Tensor) -> Evaluation:
        scores, videos = self._scores(latents)
        return Evaluation(scores, {"samples": video_grid(videos, len(self.prompts))})

    @torch.no_grad()
    def reference_media(self) -> dict[str, np.ndarray]:
        return {"teacher": video_grid(self.decode(self.teacher_samples()["reference"]), len(self.prompts))}

"""What the pipeline families' picture evaluators read pictures with: a feature model (`[eval] feature_model`) and
the CLIP score (`[eval] clip_model`), each through the model's own preprocessing (its transformers image processor),
given pictures as a pipeline outputs them (uint8 RGB, `to_uint8`).

A feature model is a transformers CLIPModel (its projected image embeddings, `get_image_features`), another vision
model such as DINOv2 (its pooled CLS token), or a built-in judge another family offers through the registry
(`builtin:digits`: the digits classifier, `dmd2.family.family_judge`). Each keeps its weights in host memory
between evaluations and works on the evaluating device (`on_device`).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from dmd2.eval_set import on_device
from dmd2.family import family_judge

BATCH = 32  # pictures per forward of a feature model: an eval set of hundreds never meets the device at once


class Judge(Protocol):
    def features(self, images: Tensor) -> Tensor:
        """Features [N, d] (on the host) of RGB pictures [N, 3, H, W] in [-1, 1]."""


def to_uint8(images: Tensor) -> list[np.ndarray]:
    """Pictures [N, 3, H, W] in [-1, 1] -> uint8 H x W x 3 arrays, rounded as StableDiffusion3Pipeline's output."""
    pixels = ((images.float().clamp(-1, 1) + 1) / 2 * 255).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).cpu().numpy())


def _embeddings(output) -> Tensor:
    """CLIP's projected embeddings: transformers 5 returns them as the output's `pooler_output`."""
    return output if isinstance(output, Tensor) else output.pooler_output


def _pixel_batches(processor, images: Tensor, device: torch.device) -> Iterator[Tensor]:
    """Pictures [N, 3, H, W] in [-1, 1] as the model's processor prepares them (uint8 first, as a pipeline outputs
    them), BATCH at a time, on ``device``."""
    for batch in images.split(BATCH):
        yield processor(images=to_uint8(batch), return_tensors="pt")["pixel_values"].to(device)


@dataclass
class _WithProcessor:
    """A transformers model and its own processor, loaded once, moved to ``device`` while it works."""

    model: nn.Module
    processor: object
    device: torch.device
    model_class: ClassVar[str]  # transformers' class names
    processor_class: ClassVar[str]

    @classmethod
    def load(cls, path: str, device: torch.device):
        import transformers

        model = getattr(transformers, cls.model_class).from_pretrained(path, use_safetensors=True)
        return cls(model.eval().requires_grad_(False), getattr(transformers, cls.processor_class).from_pretrained(path),
                   device)


@dataclass
class PretrainedJudge(_WithProcessor):
    """A transformers vision model and its image processor: CLIP's projected image embeddings, else the pooled
    output (DINOv2: the layer-normed CLS token), else the first token's hidden state."""

    model_class, processor_class = "AutoModel", "AutoImageProcessor"

    @torch.no_grad()
    def features(self, images: Tensor) -> Tensor:
        with on_device(self.model, self.device) as model:
            return torch.cat([self._forward(model, pixels).float().cpu()
                              for pixels in _pixel_batches(self.processor, images, self.device)])

    @staticmethod
    def _forward(model: nn.Module, pixels: Tensor) -> Tensor:
        if hasattr(model, "get_image_features"):  # CLIP: the embedding its text tower is aligned with
            return _embeddings(model.get_image_features(pixel_values=pixels))
        output = model(pixel_values=pixels)
        pooled = getattr(output, "pooler_output", None)
        return pooled if pooled is not None else output.last_hidden_state[:, 0]


def load_judge(spec: str, cache_dir: Path, device: torch.device) -> Judge:
    """The feature model `[eval] feature_model = spec` names: a built-in one (`builtin:<family>`, kept on the host:
    it is small) or a transformers model directory or hub id."""
    if spec.startswith("builtin:"):
        return family_judge(spec.removeprefix("builtin:")).load(cache_dir)
    return PretrainedJudge.load(spec, device)


@dataclass
class ClipScorer(_WithProcessor):
    """The CLIP score (Hessel et al. 2021): max(100 cos(image, prompt), 0) per picture, with `[eval] clip_model`'s
    own processor (CLIPProcessor: its resize, crop and normalisation, its tokenizer)."""

    model_class, processor_class = "CLIPModel", "CLIPProcessor"

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], prompt_of: Tensor) -> float:
        """The mean CLIP score of pictures [N, 3, H, W] in [-1, 1], picture i made for ``prompts[prompt_of[i]]``."""
        scores = []
        with on_device(self.model, self.device) as model:
            text = self.processor(text=prompts, return_tensors="pt", padding=True, truncation=True).to(self.device)
            text = _embeddings(model.get_text_features(**text))
            for pixels, index in zip(_pixel_batches(self.processor, images, self.device), prompt_of.split(BATCH)):
                image = _embeddings(model.get_image_features(pixel_values=pixels))
                cosine = torch.nn.functional.cosine_similarity(image, text[index.to(self.device)])
                scores.append((100 * cosine).clamp(min=0).float().cpu())
        return torch.cat(scores).mean().item()

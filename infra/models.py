"""Loading the diffusers models a trainer group trains, and what a rollout needs to know about them."""

import logging
from dataclasses import dataclass

from torch import nn

from dmd2.conditioning import ClassLabels, CondSource
from dmd2.config import DistillConfig
from dmd2.model import load_pretrained

logger = logging.getLogger(__name__)


def load_model(path: str) -> nn.Module:
    """A diffusers model from a local directory (or a hub id the machine can reach), in float32."""
    try:
        return load_pretrained(path)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"cannot load a diffusers model from {path!r} ({exc}); [model] teacher / student / critic_load "
            "must name a save_pretrained directory (resolve builtin:digits before building groups)"
        ) from exc


@dataclass(frozen=True)
class TaskSpec:
    """What every group of a run shares: the recipe, the sample shape [C, H, W] and the cond source."""

    config: DistillConfig
    sample_shape: tuple[int, ...]
    conds: CondSource


def class_conditional_task(config: DistillConfig, model_path: str) -> TaskSpec:
    """The spec of a class-conditional UNet2DModel (e.g. the digits teacher) read from its config.

    Its last class embedding is the null class that CFG was trained with (``num_class_embeds`` = classes + 1).
    """
    model_config = load_model(model_path).config
    embeds = model_config.get("num_class_embeds")
    if not embeds or embeds < 2:
        raise ValueError(f"{model_path} is not class-conditional (num_class_embeds={embeds}); "
                         "build a TaskSpec with the model's own cond source")
    size = model_config["sample_size"]
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    return TaskSpec(config, (model_config["in_channels"], *size), ClassLabels(embeds - 1, embeds - 1))

"""What the digits family accepts, decided from the recipe and config.json files alone.

The standard library only: the CLI asks `claims` and `check` (through the registry, dmd2/family.py)
before anything heavy loads, so a refused recipe costs no torch import; `DigitsFamily.claims` and
`.check` are these same functions. The shape and classes of a digits model live here for that reason.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from dmd2.config import ConfigError, DistillConfig
from dmd2.model_specs import model_dir

NUM_CLASSES = 10
"""Number of digit classes, ``0..9``."""

NULL_CLASS = 10
"""Extra class index a class-conditional model reserves for classifier-free guidance's
unconditional branch; such a model's label embedding therefore has ``NUM_CLASSES + 1`` rows."""

IMAGE_SHAPE = (1, 8, 8)
"""``(channels, height, width)`` of one digit image."""

BUILTIN_DIGITS = "builtin:digits"  # pretrained on sklearn's digits and cached on first use

# Options only a text-to-image family reads: set under the digits family, they are a mistake.
TEXT_TO_IMAGE_OPTIONS = (("data", "prompts"), ("data", "negative_prompt"), ("data", "resolution"),
                         ("data", "max_sequence_length"), ("data", "images"), ("data", "frames"),
                         ("data", "height"), ("data", "width"), ("eval", "prompts"),
                         ("eval", "clip_model"), ("eval", "feature_model"), ("eval", "samples_per_prompt"))


def digits_unet_config(path: str | Path) -> dict[str, Any] | None:
    """The config.json of a class-conditional digits UNet2DModel directory, else None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("sample_size")
    size = tuple(size) if isinstance(size, list) else (size, size)
    shape = (config.get("in_channels"), *size)
    if (config.get("_class_name") == "UNet2DModel" and config.get("num_class_embeds") == NUM_CLASSES + 1
            and shape == IMAGE_SHAPE):
        return config
    return None


def _default(section: str, name: str):
    """The option's default (the recipe left it unset)."""
    return next(f for f in dataclasses.fields(DistillConfig) if f.name == section).default_factory().__dict__[name]


def claims(teacher: str) -> bool:
    """Whether `[model] teacher` is a digits model: the built-in one, or a digits UNet directory."""
    return teacher == BUILTIN_DIGITS or digits_unet_config(teacher) is not None


def check(config: DistillConfig) -> None:
    """Refuse options the family does not read, and model specs that are not digits models."""
    unread = [f"[{section}] {name}" for section, name in TEXT_TO_IMAGE_OPTIONS
              if getattr(getattr(config, section), name) != _default(section, name)]
    if unread:
        raise ConfigError(f"{', '.join(unread)}: read only by text-to-image families; the digits family draws "
                          "class labels: remove them")
    model = config.model
    for option, spec in (("teacher", model.teacher), ("student", model.student),
                         ("critic_load", model.critic_load)):
        if not spec or spec == BUILTIN_DIGITS:
            continue
        path = model_dir(f"[model] {option}", spec)
        if path is None or digits_unet_config(path) is None:
            raise ConfigError(f"[model] {option} = {spec!r} is not a class-conditional digits UNet2DModel "
                              "directory (config.json with num_class_embeds = 11, 1 x 8 x 8 samples); use "
                              f"{BUILTIN_DIGITS!r} or a save_pretrained directory of such a model")

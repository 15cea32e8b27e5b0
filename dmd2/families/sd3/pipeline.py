"""An SD3 / SD3.5 teacher on disk: a diffusers `StableDiffusion3Pipeline` directory, checked from its JSON.

Everything here but `load_transformer` reads only the small config files (model_index.json,
scheduler/scheduler_config.json, vae/config.json, transformer/config.json), so a driver can validate a
teacher of many GB without loading a weight. Layout (diffusers `DiffusionPipeline.save_pretrained`):

    model_index.json                      {"_class_name": "StableDiffusion3Pipeline", component: [library, class]}
    scheduler/scheduler_config.json       {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, ...}
    transformer/config.json, vae/config.json, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmd2.conventions import TIMESTEP_SCALE
from dmd2.pipeline_files import read_json

if TYPE_CHECKING:  # the checks above `load_transformer` run before torch loads (dmd2/families/sd3/checks.py)
    import torch
    from torch import nn

PIPELINE_CLASS = "StableDiffusion3Pipeline"
SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
TIMESTEPS = int(TIMESTEP_SCALE)  # diffusers feeds the model t = num_train_timesteps * sigma
# FlowMatchEulerDiscreteScheduler has no prediction_type: its models predict the flow velocity v = eps - x0.
# Configs that carry the key anyway must name that target; "v_prediction" is the *diffusion* v
# (alpha eps - sigma x0), another parametrisation.
VELOCITY_PREDICTIONS = ("flow_prediction", "flow", "velocity")


def read_pipeline_index(path: str | Path) -> dict[str, Any]:
    """The pipeline's model_index.json: `_class_name` and one `[library, class]` entry per component."""
    return read_json(Path(path) / "model_index.json", f"[model] teacher {path}")


def is_sd3_pipeline(path: str | Path) -> bool:
    """True for a local directory whose model_index.json names `StableDiffusion3Pipeline` (text-to-image only)."""
    try:
        return read_pipeline_index(path).get("_class_name") == PIPELINE_CLASS
    except ValueError:
        return False


def check_sd3_pipeline(path: str | Path) -> dict[str, Any]:
    """The index of an SD3 pipeline directory; refuses any other pipeline class."""
    index = read_pipeline_index(path)
    found = index.get("_class_name")
    if found != PIPELINE_CLASS:
        raise ValueError(f"[model] teacher {path}: model_index.json names {found!r}, not {PIPELINE_CLASS!r}; "
                         f"the sd3 family distils a diffusers {PIPELINE_CLASS} directory (SD3 or SD3.5)")
    return index


def check_flow_matching(path: str | Path) -> dict[str, Any]:
    """The teacher's scheduler config, after checking it is a fixed-grid flow-matching (velocity) scheduler.

    DMD2 here assumes x_s = (1 - sigma) x0 + sigma eps with a velocity-predicting model and a
    fixed time shift (dmd2/schedule.py), which is what `FlowMatchEulerDiscreteScheduler` with
    `use_dynamic_shifting = false` describes. Callers read `shift` from the returned dict.
    """
    config_path = Path(path) / "scheduler" / "scheduler_config.json"
    config = read_json(config_path, f"[model] teacher {path}")
    found = config.get("_class_name")
    if found != SCHEDULER_CLASS:
        raise ValueError(f"[model] teacher {path}: its scheduler ({config_path}) is {found!r}; DMD2 on SD3 needs a "
                         f"flow-matching teacher with {SCHEDULER_CLASS} (velocity prediction, sigma in [0, 1]); "
                         f"point [model] teacher at a Stable Diffusion 3 / 3.5 diffusers pipeline")
    prediction = config.get("prediction_type")
    if prediction is not None and prediction not in VELOCITY_PREDICTIONS:
        raise ValueError(f"[model] teacher {path}: {config_path} has prediction_type {prediction!r}; the teacher "
                         f"must predict the flow velocity (one of {VELOCITY_PREDICTIONS}, or no such key)")
    if config.get("num_train_timesteps", TIMESTEPS) != TIMESTEPS:
        raise ValueError(f"[model] teacher {path}: {config_path} has num_train_timesteps "
                         f"{config['num_train_timesteps']}; the model's timestep must be t = {TIMESTEPS} sigma "
                         f"(dmd2/schedule.py), as in SD3 and SD3.5: use a teacher trained that way")
    if config.get("use_dynamic_shifting", False):
        raise ValueError(f"[model] teacher {path}: {config_path} sets use_dynamic_shifting = true (a shift that "
                         f"depends on the resolution); the student's grid must be fixed: set it to false and give "
                         f"`shift` explicitly in that file (SD3 and SD3.5 ship with shift = 3.0)")
    return config


def shift_of(path: str | Path) -> float:
    """The teacher's time shift (SD3's `shift`, 1 = none), from its checked scheduler config.

    With `shift_terminal` set, `shift` only shapes an inference grid (a DMD2 export stores a solved
    one, dmd2/families/sd3/export.py), not the model's time shift, so it is refused rather than guessed.
    """
    config = check_flow_matching(path)
    if config.get("shift_terminal"):
        raise ValueError(f"[model] teacher {path}: scheduler/scheduler_config.json sets shift_terminal "
                         f"{config['shift_terminal']}, so its shift {config.get('shift')} is not the model's time "
                         f"shift; give the shift explicitly (for a DMD2 export, the one its README.md names)")
    return float(config.get("shift", 1.0))


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent cell: each VAE block but the last halves the resolution (as StableDiffusion3Pipeline)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def latent_shape(path: str | Path, resolution: int) -> tuple[int, int, int]:
    """The latent shape [C, H, W] of a square `resolution` x `resolution` image of this pipeline.

    C is the VAE's `latent_channels` (the transformer's `in_channels` must agree); the resolution must
    be a multiple of vae_scale_factor * patch_size, since the MMDiT cuts latents into patches.
    """
    path = Path(path)
    vae = read_json(path / "vae" / "config.json", f"[model] teacher {path}")
    transformer = read_json(path / "transformer" / "config.json", f"[model] teacher {path}")
    channels, factor = vae["latent_channels"], vae_scale_factor(vae)
    if transformer["in_channels"] != channels:
        raise ValueError(f"[model] teacher {path}: transformer/config.json has in_channels "
                         f"{transformer['in_channels']} but vae/config.json has latent_channels {channels}; "
                         f"the transformer and the VAE must come from the same pipeline")
    multiple = factor * transformer["patch_size"]
    if resolution <= 0 or resolution % multiple:
        lower, upper = resolution // multiple * multiple, (resolution // multiple + 1) * multiple
        nearest = " or ".join(str(r) for r in (lower, upper) if r > 0)
        raise ValueError(f"[data] resolution {resolution} is not a multiple of {multiple} (vae scale factor "
                         f"{factor} x patch size {transformer['patch_size']} of {path}); use {nearest}")
    return channels, resolution // factor, resolution // factor


def load_transformer(path: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The pipeline's `SD3Transformer2DModel` (the MMDiT: teacher, student and critic all start from it), in `dtype`
    (None: float32).

    Built on the meta device, each weight goes from the safetensors straight into a tensor of `dtype`
    (`low_cpu_mem_usage`, as `dmd2.model.load_pretrained`): no full fp32 copy on the host to cast afterwards.
    """
    import torch
    from diffusers import SD3Transformer2DModel  # slow to import; only model loading needs it

    return SD3Transformer2DModel.from_pretrained(str(path), subfolder="transformer", dtype=dtype or torch.float32,
                                                 low_cpu_mem_usage=True, use_safetensors=True)

"""An SD3 / SD3.5 teacher on disk: a diffusers `StableDiffusion3Pipeline` directory, checked from its JSON.

Everything here but `load_transformer` reads only the small config files (model_index.json,
scheduler/scheduler_config.json, vae/config.json, transformer/config.json), so a driver can validate a
teacher of many GB without loading a weight. Layout (diffusers `DiffusionPipeline.save_pretrained`):

    model_index.json                      {"_class_name": "StableDiffusion3Pipeline", component: [library, class]}
    scheduler/scheduler_config.json       {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, ...}
    transformer/config.json, vae/config.json, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmd2.flow_pipeline import files
from dmd2.flow_pipeline.files import SCHEDULER_CLASS, TIMESTEPS, VELOCITY_PREDICTIONS  # noqa: F401 (re-exported)
from dmd2.pipeline_files import read_json

if TYPE_CHECKING:  # the checks above `load_transformer` run before torch loads (dmd2/families/sd3/checks.py)
    import torch
    from torch import nn

PIPELINE_CLASS = "StableDiffusion3Pipeline"
read_pipeline_index = files.read_index


def is_sd3_pipeline(path: str | Path) -> bool:
    """True for a local directory whose model_index.json names `StableDiffusion3Pipeline` (text-to-image only)."""
    return files.is_pipeline(path, (PIPELINE_CLASS,))


def check_sd3_pipeline(path: str | Path) -> dict[str, Any]:
    """The index of an SD3 pipeline directory; refuses any other pipeline class."""
    return files.check_pipeline(path, (PIPELINE_CLASS,), "sd3")


def check_flow_matching(path: str | Path) -> dict[str, Any]:
    """The teacher's scheduler config, after checking it is a fixed-grid flow-matching (velocity) scheduler.

    DMD2 here assumes x_s = (1 - sigma) x0 + sigma eps with a velocity-predicting model and a
    fixed time shift (dmd2/schedule.py), which is what `FlowMatchEulerDiscreteScheduler` with
    `use_dynamic_shifting = false` describes. Callers read `shift` from the returned dict.
    """
    config = files.scheduler_config(path, "SD3")
    if config.get("use_dynamic_shifting", False):
        raise ValueError(f"[model] teacher {path}: {Path(path) / 'scheduler' / 'scheduler_config.json'} sets "
                         f"use_dynamic_shifting = true (a shift that depends on the resolution); the student's grid "
                         f"must be fixed: set it to false and give `shift` explicitly in that file (SD3 and SD3.5 "
                         f"ship with shift = 3.0)")
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
    return files.vae_scale_factor(vae_config["block_out_channels"])


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

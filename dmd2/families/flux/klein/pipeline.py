"""A FLUX.2 [klein] teacher on disk: a diffusers `Flux2KleinPipeline` directory, read from its JSON files alone
(standard library: the CLI's checks use it). The files are laid out as FLUX.1's, so FLUX.1's reading of them
serves (dmd2/families/flux/pipeline.py: the VAE's cells, the token count, the default size):

    model_index.json                   {"_class_name": "Flux2KleinPipeline", "is_distilled": false, ...}
    scheduler/scheduler_config.json    {"_class_name": "FlowMatchEulerDiscreteScheduler", ...}
    transformer/ (Flux2Transformer2DModel: in_channels = 4 x the VAE's latent channels), vae/ (AutoencoderKLFlux2,
    a batch norm over its 2 x 2-patchified latents), text_encoder/ (Qwen3), tokenizer/

What differs from FLUX.1. The samples are the pipeline's own latent space, where it draws its noise: the VAE's cells
patchified 2 x 2 into 4 C channels and normalised by the batch norm's running statistics, [4 C, H / 16, W / 16] at
8 px per cell. `mu` is `compute_empirical_mu` of the token count and of the step count, so the run's shift is the
pipeline's at the student's steps: its grid is the one the stock pipeline samples at that many steps. A step-distilled
klein (`is_distilled`) ignores guidance_scale. No published configs are kept (none is on this machine to ground
them): `dmd2 plan` reads a local directory, or a hub id's snapshot in the hub cache.
"""

from pathlib import Path
from typing import Any

from dmd2.config import ConfigError, DistillConfig
from dmd2.families.flux import pipeline as flux
from dmd2.flow_pipeline import files
from dmd2.model_specs import model_dir
from dmd2.pipeline_files import read_json

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
FAMILY = "flux2_klein"


def teacher_dir(teacher: str) -> str:
    """The local directory of `teacher`: itself, or a hub id's snapshot in the hub cache."""
    path = model_dir("[model] teacher", teacher)
    if path is None:
        raise ConfigError(f"[model] teacher = {teacher!r} is not in the hub cache, and the {FAMILY} family keeps no "
                          "published configs to plan it from; download it (huggingface-cli download "
                          f"{teacher} --local-dir DIR) and set [model] teacher = DIR")
    return str(path)


def check_klein_pipeline(teacher: str) -> dict[str, Any]:
    return files.check_pipeline(teacher_dir(teacher), PIPELINE_CLASSES, FAMILY)


def transformer_config(teacher: str) -> dict[str, Any]:
    return read_json(Path(teacher_dir(teacher)) / "transformer" / "config.json", f"[model] teacher {teacher}")


def latent_shape(teacher: str, resolution: int) -> tuple[int, int, int]:
    """[4 C, H / 2f, W / 2f] of a square `resolution` image: the VAE's cells (checked as FLUX.1's: a multiple of 2 f,
    the transformer's in_channels 4 C), patchified 2 x 2 (`Flux2KleinPipeline.prepare_latents`' shape)."""
    channels, height, width = flux.latent_shape(teacher_dir(teacher), resolution)
    return channels * files.PACK * files.PACK, height // files.PACK, width // files.PACK


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """mu for `image_seq_len` tokens sampled in `num_steps` steps: Flux2KleinPipeline's `compute_empirical_mu`
    (diffusers 0.42): above 4300 tokens a line in the tokens; below, the line in the steps through its values at 10
    and 200 steps, each a line in the tokens (fewer steps, more shift)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    at_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return at_200
    at_10 = a1 * image_seq_len + b1
    slope = (at_200 - at_10) / 190.0
    intercept = at_200 - 200.0 * slope
    return slope * num_steps + intercept


def teacher_shift(teacher: str, resolution: int, num_steps: int) -> float:
    """The shift of the pipeline's sigmas at `resolution` and `num_steps` steps: e^mu of `empirical_mu` under
    `use_dynamic_shifting`, else the scheduler's fixed `shift`."""
    path = teacher_dir(teacher)
    scheduler = files.scheduler_config(path, "FLUX.2 [klein]")
    if not scheduler.get("use_dynamic_shifting"):
        return float(scheduler.get("shift", 1.0))
    return files.shift_of_mu(scheduler, empirical_mu(flux.image_tokens(path, resolution), num_steps))


def default_resolution(teacher: str) -> int:
    """Flux2KleinPipeline's default size, FLUX.1's rule: 128 cells of the VAE's factor (1024 px)."""
    return flux.default_resolution(teacher_dir(teacher))


def check_guidance(teacher: str, config: DistillConfig) -> None:
    """Refuse a guidance scale that the teacher's pipeline would ignore: a step-distilled klein's."""
    scale = config.dmd2.teacher_guidance_scale if config.dmd2 is not None else 1.0
    if scale != 1.0 and files.read_index(teacher_dir(teacher)).get("is_distilled", False):
        raise ValueError(f"[dmd2] teacher_guidance_scale = {scale:g}: the teacher {teacher} is a step-distilled "
                         "FLUX.2 [klein] (model_index.json: is_distilled = true), whose pipeline ignores "
                         "guidance_scale; set it to 1, or distil the undistilled base model (FLUX.2 [klein] Base)")

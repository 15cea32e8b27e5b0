"""A FLUX.1 teacher on disk: a diffusers `FluxPipeline` directory (or a published hub id, from the configs kept in
`published`), read from its JSON files alone (standard library: the CLI's checks use it).

Layout (diffusers `FluxPipeline.save_pretrained`, as the black-forest-labs hub snapshots):

    model_index.json                   {"_class_name": "FluxPipeline", ...}
    scheduler/scheduler_config.json    {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": true,
                                        "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                                        "max_image_seq_len": 4096, ...}
    transformer/ (FluxTransformer2DModel: in_channels = 4 x the VAE's latent channels, 2 x 2 patches packed),
    vae/ (AutoencoderKL, scaling_factor and shift_factor), text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizers

FluxPipeline computes `mu` from the image's token count, (H / 16) (W / 16) for H x W pixels (8 x the VAE, then 2 x 2
packing), and shifts its sigmas by e^mu (dmd2/flow_pipeline/files.py): at the run's resolution, the teacher's shift.
"""

from pathlib import Path
from typing import Any

from dmd2.flow_pipeline import files
from dmd2.pipeline_files import read_json

PIPELINE_CLASSES = ("FluxPipeline",)


def check_flux_pipeline(path: str | Path) -> dict[str, Any]:
    return files.check_pipeline(path, PIPELINE_CLASSES, "flux")


def _configs(teacher: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(transformer, vae, scheduler) configs of a directory or of a published hub id."""
    from dmd2.families.flux.published import PUBLISHED

    if teacher in PUBLISHED:
        return PUBLISHED[teacher]
    return (read_json(Path(teacher) / "transformer" / "config.json", f"[model] teacher {teacher}"),
            read_json(Path(teacher) / "vae" / "config.json", f"[model] teacher {teacher}"),
            files.scheduler_config(teacher, "FLUX"))


def latent_shape(teacher: str, resolution: int) -> tuple[int, int, int]:
    """The latent shape [C, H / f, W / f] of a square `resolution` image (f: the VAE's factor); the resolution must be
    a multiple of 2 f (the packing), and the transformer's in_channels 4 C."""
    transformer, vae, _ = _configs(teacher)
    return files.packed_latent_shape(teacher, resolution, vae["latent_channels"], files.vae_scale_factor(
        vae["block_out_channels"]), transformer["in_channels"], "latent_channels")


def image_tokens(teacher: str, resolution: int) -> int:
    """The packed image's token count at `resolution`: FluxPipeline's `image_seq_len`."""
    _, height, width = latent_shape(teacher, resolution)
    return (height // files.PACK) * (width // files.PACK)


def teacher_shift(teacher: str, resolution: int) -> float:
    """The teacher's time shift at `resolution`: e^mu, mu = the pipeline's `calculate_shift` of its token count under
    `use_dynamic_shifting`; else the scheduler's fixed `shift`."""
    _, _, scheduler = _configs(teacher)
    if scheduler.get("use_dynamic_shifting"):
        return files.dynamic_shift(scheduler, image_tokens(teacher, resolution))
    return float(scheduler.get("shift", 1.0))


def default_resolution(teacher: str) -> int:
    """FluxPipeline's default size: 128 latent cells of 8 px, 1024 px (its `default_sample_size`)."""
    _, vae, _ = _configs(teacher)
    return 128 * files.vae_scale_factor(vae["block_out_channels"])


def check_sequence_split(teacher: str, resolution: int, text_tokens: int, ranks: int) -> None:
    """Refuse `[train] sequence_parallel = ranks` where it cannot split a sample: FluxTransformer2DModel's context-
    parallel plan splits the image's tokens and the text's (and their ids) over the ranks."""
    transformer, _, _ = _configs(teacher)
    files.check_sequence_split(teacher, ranks, transformer["num_attention_heads"], {
        f"image tokens of a {resolution} px picture": image_tokens(teacher, resolution),
        "text tokens ([data] max_sequence_length)": text_tokens}, "[data] resolution or max_sequence_length")

"""A Qwen-Image teacher on disk: a diffusers `QwenImagePipeline` directory (or the published hub id, from the configs
kept in `published`), read from its JSON files alone (standard library: the CLI's checks use it).

Layout (diffusers `QwenImagePipeline.save_pretrained`, as the Qwen/Qwen-Image hub snapshot):

    model_index.json                   {"_class_name": "QwenImagePipeline", ...}
    scheduler/scheduler_config.json    {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": true,
                                        "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                                        "max_image_seq_len": 8192, "shift_terminal": 0.02, ...}
    transformer/ (QwenImageTransformer2DModel: 2 x 2 patches packed into 4 z_dim channels), vae/
    (AutoencoderKLQwenImage: z_dim channels, `latents_mean` / `latents_std` per channel, 2 ** len(temperal_downsample)
    pixels per cell), text_encoder/ (Qwen2.5-VL), tokenizer/

QwenImagePipeline computes `mu` from the packed image's token count and shifts its sigmas by e^mu
(dmd2/flow_pipeline/files.py): at the run's resolution, the teacher's shift. Its `shift_terminal` (0.02) stretches
the inference grid's last sigma; it is no part of the model's time shift, and the student's grid does not use it.
"""

from pathlib import Path
from typing import Any

from dmd2.flow_pipeline import files
from dmd2.pipeline_files import read_json

PIPELINE_CLASSES = ("QwenImagePipeline",)


def check_qwen_image_pipeline(path: str | Path) -> dict[str, Any]:
    return files.check_pipeline(path, PIPELINE_CLASSES, "qwen_image")


def _configs(teacher: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(transformer, vae, scheduler) configs of a directory or of the published hub id."""
    from dmd2.families.qwen_image.published import PUBLISHED

    if teacher in PUBLISHED:
        return PUBLISHED[teacher]
    return (read_json(Path(teacher) / "transformer" / "config.json", f"[model] teacher {teacher}"),
            read_json(Path(teacher) / "vae" / "config.json", f"[model] teacher {teacher}"),
            files.scheduler_config(teacher, "Qwen-Image"))


def vae_factor(vae: dict[str, Any]) -> int:
    """Pixels per latent cell: QwenImagePipeline's `vae_scale_factor`, 2 ** len(temperal_downsample) (8)."""
    return 2 ** len(vae.get("temperal_downsample", [False, True, True]))


def latent_shape(teacher: str, resolution: int) -> tuple[int, int, int]:
    """The latent shape [C, H / f, W / f] of a square `resolution` image (C: the VAE's z_dim; the one frame of its
    video VAE dropped); the resolution must be a multiple of 2 f, the transformer's in_channels 4 C."""
    transformer, vae, _ = _configs(teacher)
    return files.packed_latent_shape(teacher, resolution, vae["z_dim"], vae_factor(vae), transformer["in_channels"],
                                     "z_dim")


def teacher_shift(teacher: str, resolution: int) -> float:
    """The teacher's time shift at `resolution`: e^mu of the pipeline's `calculate_shift` of the packed image's token
    count under `use_dynamic_shifting`, else the scheduler's fixed `shift`."""
    _, _, scheduler = _configs(teacher)
    _, height, width = latent_shape(teacher, resolution)
    if scheduler.get("use_dynamic_shifting"):
        return files.dynamic_shift(scheduler, (height // files.PACK) * (width // files.PACK))
    return float(scheduler.get("shift", 1.0))


def default_resolution(teacher: str) -> int:
    """QwenImagePipeline's default size: 128 latent cells (its `default_sample_size`), 1024 px."""
    return 128 * vae_factor(_configs(teacher)[1])


def check_sequence_split(teacher: str, resolution: int, ranks: int) -> None:
    """Refuse `[train] sequence_parallel = ranks` where it cannot split a sample's image tokens (its text is padded
    to a multiple of the ranks by `QwenImageVelocity`, masked)."""
    transformer, _, _ = _configs(teacher)
    _, height, width = latent_shape(teacher, resolution)
    files.check_sequence_split(teacher, ranks, transformer["num_attention_heads"], {
        f"image tokens of a {resolution} px picture": (height // files.PACK) * (width // files.PACK)},
        "[data] resolution")

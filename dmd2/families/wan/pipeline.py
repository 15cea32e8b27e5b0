"""A Wan 2.1 / 2.2 teacher on disk: a diffusers `WanPipeline` directory, checked from its JSON files.

Everything here reads only the small config files, so a driver validates a teacher of many GB without loading a
weight. Layout (diffusers `WanPipeline.save_pretrained`, as the Wan-AI `*-Diffusers` hub snapshots):

    model_index.json                   {"_class_name": "WanPipeline", "boundary_ratio": null | 0.875, ...}
    scheduler/scheduler_config.json    {"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": true,
                                        "prediction_type": "flow_prediction", "flow_shift": 3.0, ...}
    transformer/, transformer_2/ (Wan 2.2 A14B's low-noise expert), vae/ (AutoencoderKLWan), text_encoder/ (UMT5),
    tokenizer/

A DMD2 export of a Wan student carries a FlowMatchEulerDiscreteScheduler solved for the student's grid
(dmd2/families/wan/export.py); its README.md names the model's shift.
"""

from pathlib import Path
from typing import Any

from dmd2.conventions import TIMESTEP_SCALE
from dmd2.flow_pipeline import files
from dmd2.pipeline_files import read_json

PIPELINE_CLASS = "WanPipeline"
TIMESTEPS = int(TIMESTEP_SCALE)  # diffusers feeds the model t = num_train_timesteps * sigma
UNIPC = "UniPCMultistepScheduler"
EXPERTS = ("transformer", "transformer_2")  # Wan 2.2 A14B: high-noise expert, then low-noise expert
DEFAULT_FRAMES, DEFAULT_HEIGHT, DEFAULT_WIDTH = 81, 480, 832  # WanPipeline's defaults (480p)


def read_index(path: str | Path) -> dict[str, Any]:
    return read_json(Path(path) / "model_index.json", f"[model] teacher {path}")


def is_wan_pipeline(path: str | Path) -> bool:
    """True for a local directory whose model_index.json names `WanPipeline` (text-to-video)."""
    try:
        return read_index(path).get("_class_name") == PIPELINE_CLASS
    except ValueError:
        return False


def check_wan_pipeline(path: str | Path) -> dict[str, Any]:
    """The index of a Wan pipeline directory; refuses any other pipeline class and a layout this family cannot run."""
    index = read_index(path)
    found = index.get("_class_name")
    if found != PIPELINE_CLASS:
        raise ValueError(f"[model] teacher {path}: model_index.json names {found!r}, not {PIPELINE_CLASS!r}; the wan "
                         f"family distils a diffusers {PIPELINE_CLASS} directory (Wan 2.1 / 2.2 text-to-video)")
    if index.get("expand_timesteps"):
        raise ValueError(f"[model] teacher {path}: model_index.json sets expand_timesteps (Wan2.2-TI2V-5B's per-token "
                         "timesteps, which condition on an image); the wan family distils text-to-video with one "
                         "timestep per sample")
    return index


def experts(path: str | Path) -> tuple[list[str], float | None]:
    """The pipeline's transformers in the order they denoise and its `boundary_ratio`: (["transformer"], None) for
    Wan 2.1, (["transformer", "transformer_2"], ratio) for Wan 2.2 A14B's two experts."""
    index = check_wan_pipeline(path)
    present = [name for name in EXPERTS if isinstance(index.get(name), list) and index[name][0]]
    ratio = index.get("boundary_ratio")
    if present == ["transformer"]:
        return present, None
    if present == list(EXPERTS) and isinstance(ratio, (int, float)) and 0 < ratio < 1:
        return present, float(ratio)
    raise ValueError(f"[model] teacher {path}: model_index.json has transformers {present} and boundary_ratio "
                     f"{ratio!r}; the wan family takes `transformer` alone (Wan 2.1) or `transformer` and "
                     "`transformer_2` with a boundary_ratio in (0, 1) (Wan 2.2 A14B)")


def flow_shift_of(path: str | Path) -> float:
    """The model's time shift: UniPC's `flow_shift` in flow-prediction mode (Wan 2.1 / 2.2 ship it), the SD3 shift
    sigma' = shift s / (1 + (shift - 1) s)."""
    config_path = Path(path) / "scheduler" / "scheduler_config.json"
    config = read_json(config_path, f"[model] teacher {path}")
    found = config.get("_class_name")
    if config.get("num_train_timesteps", TIMESTEPS) != TIMESTEPS:
        raise ValueError(f"[model] teacher {path}: {config_path} has num_train_timesteps "
                         f"{config['num_train_timesteps']}; the model's timestep must be t = {TIMESTEPS} sigma")
    if found == UNIPC:
        if not config.get("use_flow_sigmas") or config.get("prediction_type") != "flow_prediction":
            raise ValueError(f"[model] teacher {path}: {config_path} is UniPC without flow sigmas and flow prediction "
                             "(use_flow_sigmas true, prediction_type \"flow_prediction\", as Wan ships it); DMD2 here "
                             "needs a flow-matching velocity model")
        return float(config.get("flow_shift", 1.0))
    raise ValueError(f"[model] teacher {path}: its scheduler ({config_path}) is {found!r}; the wan family needs "
                     f"{UNIPC} in flow-prediction mode, as Wan ships it (a DMD2 export's scheduler is solved for its "
                     "student's grid and does not hold the model's shift: distil from the original teacher)")


def vae_factors(path: str | Path) -> tuple[int, int, int]:
    """(latent channels, temporal factor, spatial factor) of the pipeline's AutoencoderKLWan: (16, 4, 8) for Wan 2.1,
    (48, 4, 16) for Wan 2.2's TI2V VAE."""
    vae = read_json(Path(path) / "vae" / "config.json", f"[model] teacher {path}")
    return vae["z_dim"], vae.get("scale_factor_temporal") or 4, vae.get("scale_factor_spatial") or 8


def video_size(data: Any) -> tuple[int, int, int]:
    """(frames, height, width) of the run's videos from `[data]` (a DataConfig): `height` and `width`, else the square
    `resolution`, else WanPipeline's defaults (81 frames of 480 x 832)."""
    return (data.frames or DEFAULT_FRAMES, data.height or data.resolution or DEFAULT_HEIGHT,
            data.width or data.resolution or DEFAULT_WIDTH)


def latent_shape(path: str | Path, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """The latent shape [C, (F - 1) / t + 1, H / s, W / s] of an F-frame H x W video of this pipeline (t, s: its
    VAE's temporal and spatial factors). F must be t k + 1 and H, W multiples of s times the patch size. A published
    teacher's hub id (dmd2/families/wan/published.py) is read from the configs kept here."""
    from dmd2.families.wan.published import TRANSFORMERS, VAE

    if str(path) in TRANSFORMERS:
        (channels, temporal, spatial), transformer = VAE, TRANSFORMERS[str(path)]
    else:
        path = Path(path)
        channels, temporal, spatial = vae_factors(path)
        transformer = read_json(path / "transformer" / "config.json", f"[model] teacher {path}")
    if transformer["in_channels"] != channels:
        raise ValueError(f"[model] teacher {path}: transformer/config.json has in_channels "
                         f"{transformer['in_channels']} but the VAE's z_dim is {channels}; the transformer and the VAE "
                         "must come from the same pipeline")
    if frames < 1 or (frames - 1) % temporal:
        lower = (max(frames, 1) - 1) // temporal * temporal + 1
        raise ValueError(f"[data] frames {frames} is not {temporal} k + 1 (the VAE compresses {temporal} frames into "
                         f"one after the first); use {lower} or {lower + temporal}")
    _, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    for option, size, patch in (("height", height, patch_h), ("width", width, patch_w)):
        multiple = spatial * patch
        if size <= 0 or size % multiple:
            nearest = " or ".join(str(v) for v in (size // multiple * multiple, (size // multiple + 1) * multiple) if v)
            raise ValueError(f"[data] {option} {size} is not a multiple of {multiple} (vae scale factor {spatial} x "
                             f"patch size {patch} of {path}); use {nearest}")
    return channels, (frames - 1) // temporal + 1, height // spatial, width // spatial


def transformer_config(path: str | Path) -> dict[str, Any]:
    """The first transformer's config.json (a published teacher's kept here, by hub id)."""
    from dmd2.families.wan.published import TRANSFORMERS

    if str(path) in TRANSFORMERS:
        return TRANSFORMERS[str(path)]
    return read_json(Path(path) / "transformer" / "config.json", f"[model] teacher {path}")


def check_sequence_split(path: str | Path, frames: int, height: int, width: int, ranks: int) -> None:
    """Refuse `[train] sequence_parallel = ranks` where Ulysses cannot split this teacher's videos (their tokens:
    latent frames x patches)."""
    if ranks == 1:
        return
    transformer = transformer_config(path)
    _, latent_frames, latent_h, latent_w = latent_shape(path, frames, height, width)
    patch_t, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    rows, columns = latent_h // patch_h, latent_w // patch_w
    what = (f"tokens of a {frames} x {height} x {width} video ({latent_frames // patch_t} latent frames x {rows} x "
            f"{columns} patches)")
    files.check_sequence_split(str(path), ranks, transformer.get("num_attention_heads", 40),
                               {what: latent_frames // patch_t * rows * columns}, "[data] frames, height or width")

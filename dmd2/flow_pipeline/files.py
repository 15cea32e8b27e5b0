"""A flow-matching pipeline on disk, read from its JSON files alone (standard library: the CLI's checks use it before
anything heavy loads): its model_index.json, its FlowMatchEulerDiscreteScheduler and the time shift it applies at a
resolution, its VAE's scale factor, and digests of its components' files.

The time shift. `FlowMatchEulerDiscreteScheduler` shifts sigma either by a fixed `shift` (SD3's
sigma' = shift s / (1 + (shift - 1) s)) or, with `use_dynamic_shifting`, by `mu` that the pipeline computes from the
image's token count (FLUX, Qwen-Image: `calculate_shift`, linear in the tokens between `base_image_seq_len` and
`max_image_seq_len`). Its exponential time shift e^mu / (e^mu + 1/s - 1) is SD3's shift with shift = e^mu (the linear
one: shift = mu), so at a fixed resolution a dynamic teacher has one fixed shift, which the student's grid uses.
"""

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from dmd2.conventions import TIMESTEP_SCALE
from dmd2.pipeline_files import file_sha256, read_json

SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
TIMESTEPS = int(TIMESTEP_SCALE)  # diffusers' scheduler timestep t = num_train_timesteps * sigma
# FlowMatchEulerDiscreteScheduler has no prediction_type: its models predict the flow velocity v = eps - x0.
# Configs that carry the key anyway must name that target; "v_prediction" is the *diffusion* v.
VELOCITY_PREDICTIONS = ("flow_prediction", "flow", "velocity")


def local_pipeline(spec: str) -> str:
    """A pipeline directory for `spec`: itself when it is one, else the hub snapshot of that id."""
    if Path(spec).is_dir():
        return spec
    from huggingface_hub import snapshot_download  # a user's cluster fetches it once into the HF cache

    return snapshot_download(spec)


def read_index(path: str | Path) -> dict[str, Any]:
    """The pipeline's model_index.json: `_class_name` and one `[library, class]` entry per component."""
    return read_json(Path(path) / "model_index.json", f"[model] teacher {path}")


def is_pipeline(path: str | Path, classes: tuple[str, ...]) -> bool:
    """True for a local directory whose model_index.json names one of `classes`."""
    try:
        return read_index(path).get("_class_name") in classes
    except ValueError:
        return False


def check_pipeline(path: str | Path, classes: tuple[str, ...], family: str) -> dict[str, Any]:
    """The index of a pipeline directory of one of `classes`; refuses any other pipeline class."""
    index = read_index(path)
    found = index.get("_class_name")
    if found not in classes:
        raise ValueError(f"[model] teacher {path}: model_index.json names {found!r}, not "
                         f"{' or '.join(map(repr, classes))}; the {family} family distils a diffusers "
                         f"{' or '.join(classes)} directory")
    return index


def present(index: dict[str, Any], name: str) -> bool:
    """Whether the index lists component `name` (a null entry is an absent component)."""
    return isinstance(index.get(name), list) and bool(index[name][0])


def scheduler_config(path: str | Path, family: str) -> dict[str, Any]:
    """The teacher's scheduler config, after checking it is a flow-matching (velocity) scheduler with t = 1000 sigma."""
    config_path = Path(path) / "scheduler" / "scheduler_config.json"
    config = read_json(config_path, f"[model] teacher {path}")
    found = config.get("_class_name")
    if found != SCHEDULER_CLASS:
        raise ValueError(f"[model] teacher {path}: its scheduler ({config_path}) is {found!r}; DMD2 on {family} "
                         f"needs a flow-matching teacher with {SCHEDULER_CLASS} (velocity prediction, sigma in [0, 1])")
    prediction = config.get("prediction_type")
    if prediction is not None and prediction not in VELOCITY_PREDICTIONS:
        raise ValueError(f"[model] teacher {path}: {config_path} has prediction_type {prediction!r}; the teacher "
                         f"must predict the flow velocity (one of {VELOCITY_PREDICTIONS}, or no such key)")
    if config.get("num_train_timesteps", TIMESTEPS) != TIMESTEPS:
        raise ValueError(f"[model] teacher {path}: {config_path} has num_train_timesteps "
                         f"{config['num_train_timesteps']}; the model's timestep must be t = {TIMESTEPS} sigma")
    return config


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """mu for an image of `image_seq_len` tokens: FluxPipeline's and QwenImagePipeline's `calculate_shift` (the
    line through (base_seq_len, base_shift) and (max_seq_len, max_shift)), with the scheduler config's values."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def mu_of(config: dict[str, Any], image_seq_len: int) -> float:
    """The `mu` the pipeline passes to this scheduler config for an image of `image_seq_len` tokens."""
    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def dynamic_shift(config: dict[str, Any], image_seq_len: int) -> float:
    """The fixed shift equal to the scheduler's dynamic time shift at `image_seq_len` tokens (module docstring)."""
    return shift_of_mu(config, mu_of(config, image_seq_len))


def shift_of_mu(config: dict[str, Any], mu: float) -> float:
    """The fixed shift equal to this scheduler config's dynamic time shift at `mu`, however the pipeline computed it
    (FLUX.2 [klein]'s `compute_empirical_mu` is no `calculate_shift`)."""
    return mu if config.get("time_shift_type", "exponential") == "linear" else math.exp(mu)


def vae_scale_factor(block_out_channels: list[int]) -> int:
    """Pixels per latent cell: each VAE block but the last halves the resolution (as the pipelines compute it)."""
    return 2 ** (len(block_out_channels) - 1)


def text_components(index: dict[str, Any]) -> list[str]:
    """The index's text encoders and tokenizers that are present."""
    return sorted(name for name in index if name.startswith(("text_encoder", "tokenizer")) and present(index, name))


def components_fingerprint(pipeline_dir: str | Path, index: dict[str, Any], names: list[str]) -> str:
    """sha256 hex over the pipeline's components `names`: their classes in model_index.json, and per file its path,
    size and content sha256. Changes whenever anything that shapes what they compute changes."""
    pipeline_dir = Path(pipeline_dir)
    digest = hashlib.sha256()
    for name in names:
        digest.update(json.dumps([name, index[name]]).encode())
        for file in sorted(p for p in (pipeline_dir / name).rglob("*") if p.is_file()):
            relative = file.relative_to(pipeline_dir).as_posix()
            digest.update(json.dumps([relative, file.stat().st_size, file_sha256(file)]).encode())
    return digest.hexdigest()


def check_sequence_split(teacher: str, ranks: int, heads: int, tokens: dict[str, int], fix: str) -> None:
    """Refuse `[train] sequence_parallel = ranks` where Ulysses cannot split a sample of ``teacher``: each rank takes
    1 / ranks of each of its token sequences (``tokens``: what they are -> how many) and, inside attention, 1 / ranks
    of the ``heads``; ``fix``: the options that set the sequences' lengths."""
    if ranks == 1:
        return
    if heads % ranks:
        raise ValueError(f"[train] sequence_parallel = {ranks} does not divide the {heads} attention heads of "
                         f"{teacher} (Ulysses gives each rank heads / sequence_parallel of them); use a divisor of "
                         f"{heads}")
    for what, count in tokens.items():
        if count % ranks:
            raise ValueError(f"[train] sequence_parallel = {ranks} does not divide the {count} {what}; change {fix}, "
                             "or sequence_parallel")


PACK = 2  # 2 x 2 latent cells per token


def packed_latent_shape(teacher: str, resolution: int, channels: int, factor: int, in_channels: int,
                        channels_name: str) -> tuple[int, int, int]:
    """The latent shape [C, H / f, W / f] of a square `resolution` image (f: the VAE's `factor`, C its `channels`,
    named `channels_name` in its config), checked against packing: the transformer's `in_channels` must be 4 C and
    the resolution a multiple of 2 f."""
    if in_channels != PACK * PACK * channels:
        raise ValueError(f"[model] teacher {teacher}: transformer/config.json has in_channels {in_channels}, not 4 x "
                         f"the VAE's {channels_name} {channels} (2 x 2 latent cells are packed per token); the "
                         "transformer and the VAE must come from the same pipeline")
    multiple = factor * PACK
    if resolution <= 0 or resolution % multiple:
        lower = resolution // multiple * multiple
        nearest = " or ".join(str(r) for r in (lower, lower + multiple) if r > 0)
        raise ValueError(f"[data] resolution {resolution} is not a multiple of {multiple} (vae scale factor {factor} x "
                         f"the 2 x 2 packing of {teacher}); use {nearest}")
    return channels, resolution // factor, resolution // factor

"""The GAN discriminator's real samples for SD3 (`[data] images`): the folder's images as the teacher's latents.

Encoded once per image set (`SD3Family.prepare`, on a Ray worker), like the prompts: each image is
center-cropped to a square, resized to `[data] resolution`, scaled to [-1, 1] and encoded by the pipeline's
VAE (the mean of its latent distribution), then z = (mean - shift_factor) * scaling_factor, the inverse of
what StableDiffusion3Pipeline does before decoding (`latents / scaling_factor + shift_factor`). Captions
become rows of the prompt table (`caption_rows`), so a real sample's cond is a prompt index like a fake's.
`images_digest` says when stored latents are still valid: same files, captions, resolution and VAE files.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dmd2.families.sd3.image_folder import RealImage
from dmd2.families.sd3.prompts import file_sha256

PREPROCESSING = "center-crop, lanczos resize, [-1, 1], latent mean"  # in the digest: a change re-encodes


def images_digest(images: list[RealImage], resolution: int, vae_fingerprint: str) -> str:
    """sha256 hex of everything the encoded images depend on: per image (sorted by name) its name, content
    sha256 and caption; the resolution, the VAE's files and the preprocessing."""
    payload = {"images": [[image.path.name, file_sha256(image.path), image.caption] for image in images],
               "resolution": resolution, "vae": vae_fingerprint, "preprocessing": PREPROCESSING}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def caption_rows(prompts: list[str], captions: list[str]) -> tuple[list[str], Tensor]:
    """(The prompt table's rows: `prompts` then each caption not among them, the caption's row per image
    (int64 [N])). A caption already a row reuses it: the table grows by the distinct new captions only."""
    rows, position = list(prompts), {}
    for index, prompt in enumerate(prompts):
        position.setdefault(prompt, index)
    for caption in captions:
        if caption not in position:
            position[caption] = len(rows)
            rows.append(caption)
    return rows, torch.tensor([position[caption] for caption in captions], dtype=torch.long)


def image_pixels(path: Path, resolution: int) -> Tensor:
    """An image file -> [3, resolution, resolution] float32 in [-1, 1]: the central square, resized (Lanczos)."""
    from PIL import Image, UnidentifiedImageError  # only encoding reads pixels

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise ValueError(f"[data] images: {path} is not a readable image ({error}); fix or remove it") from error
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = image.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.Resampling.LANCZOS)
    pixels = torch.from_numpy(np.asarray(square, dtype=np.float32).copy()).permute(2, 0, 1)
    return pixels / 127.5 - 1


@torch.no_grad()
def encode_images(vae: Any, paths: list[Path], resolution: int, batch_size: int = 8) -> Tensor:
    """The latents z [N, C, resolution / f, resolution / f] (float32, on CPU) of the images, f the VAE's scale
    factor: z = (E[q(z | x)] - shift_factor) * scaling_factor, in batches of `batch_size`."""
    device, dtype = next(vae.parameters()).device, next(vae.parameters()).dtype
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    latents = []
    for start in range(0, len(paths), batch_size):
        pixels = torch.stack([image_pixels(path, resolution) for path in paths[start:start + batch_size]])
        mean = vae.encode(pixels.to(device, dtype)).latent_dist.mean
        latents.append(((mean.float() - shift) * scale).cpu())
    return torch.cat(latents)


def load_vae(pipeline_dir: str | Path) -> Any:
    """The pipeline's `AutoencoderKL`, float32, in eval mode."""
    from diffusers import AutoencoderKL  # slow to import; only encoding needs it

    return AutoencoderKL.from_pretrained(str(pipeline_dir), subfolder="vae", low_cpu_mem_usage=False,
                                         use_safetensors=True).eval()

"""Prompts for an SD3 teacher: the encoded table, and digests that key a cached table (the prompt file is
read by `prompt_file`, which imports no torch, so the CLI checks it before anything heavy loads).

Encoding is done once, by the pipeline's own text encoders (two CLIPs and a T5), into a table of P
rows; rollouts and records then carry prompt indices (dmd2/families/sd3/conditioning.py). The
digests say when a cached table is still valid: same prompts, negative prompt, sequence length and
text encoder files.
"""

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmd2.families.sd3.pipeline import check_sd3_pipeline
from dmd2.pipeline_files import CHUNK_BYTES, file_sha256, prompts_digest  # noqa: F401 (re-exported)
from dmd2.families.sd3.prompt_file import read_prompts  # noqa: F401 (re-exported: the prompts as read)

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default T5 length
TABLE_KEYS = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")


def _encoder_components(index: dict[str, Any]) -> list[str]:
    """The index's text encoders and tokenizers that are present (null entries are absent components)."""
    return sorted(name for name, entry in index.items()
                  if name.startswith(("text_encoder", "tokenizer")) and isinstance(entry, list) and entry[0])


def encoder_fingerprint(pipeline_dir: str | Path) -> str:
    """sha256 hex over the text encoders' and tokenizers' files: their classes, and per file its path,
    size and content sha256. Changes whenever anything that shapes a prompt embedding changes."""
    return components_fingerprint(pipeline_dir, _encoder_components(check_sd3_pipeline(pipeline_dir)))


def components_fingerprint(pipeline_dir: str | Path, names: list[str]) -> str:
    """sha256 hex over the pipeline's components `names` (e.g. ["vae"]): their classes in model_index.json,
    and per file its path, size and content sha256."""
    pipeline_dir = Path(pipeline_dir)
    index = check_sd3_pipeline(pipeline_dir)
    digest = hashlib.sha256()
    for name in names:
        digest.update(json.dumps([name, index[name]]).encode())
        for file in sorted(p for p in (pipeline_dir / name).rglob("*") if p.is_file()):
            relative = file.relative_to(pipeline_dir).as_posix()
            digest.update(json.dumps([relative, file.stat().st_size, file_sha256(file)]).encode())
    return digest.hexdigest()


def _encode(pipeline: Any, prompts: list[str], max_sequence_length: int) -> tuple[Tensor, Tensor]:
    """One `encode_prompt` call: ([B, L, D], [B, Dp]) on CPU.

    L = the CLIP tokenizer's length (77 for SD3) + max_sequence_length; D = T5's width, the CLIP hidden
    states (concatenated) zero-padded to it; Dp = the two CLIP projections concatenated.
    """
    embeds, _, pooled, _ = pipeline.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length)
    return embeds.cpu(), pooled.cpu()


@torch.no_grad()  # encode_prompt itself records autograd graphs
def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str, batch_size: int = 8,
                        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> dict[str, Tensor]:
    """Encode P prompts and the negative prompt with the pipeline's own `encode_prompt`.

    Returns {"prompt_embeds": [P, L, D], "pooled_prompt_embeds": [P, Dp], "negative_prompt_embeds":
    [1, L, D], "negative_pooled_prompt_embeds": [1, Dp]} on CPU, in the encoders' dtype. The prompts
    go in batches of `batch_size` (ceil(P / batch_size) calls) and the negative prompt as its own row
    (one call): every encoder pads to a fixed length, so a row does not depend on its batch.
    """
    if not prompts:
        raise ValueError("[data] prompts: no prompt to encode; give at least one")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches = [_encode(pipeline, prompts[i * batch_size:(i + 1) * batch_size], max_sequence_length)
               for i in range(math.ceil(len(prompts) / batch_size))]
    negative_embeds, negative_pooled = _encode(pipeline, [negative_prompt], max_sequence_length)
    return {
        "prompt_embeds": torch.cat([embeds for embeds, _ in batches]),
        "pooled_prompt_embeds": torch.cat([pooled for _, pooled in batches]),
        "negative_prompt_embeds": negative_embeds,
        "negative_pooled_prompt_embeds": negative_pooled,
    }


def load_text_pipeline(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A `StableDiffusion3Pipeline` holding only the text encoders and tokenizers (no MMDiT, no VAE).

    diffusers skips loading a component passed as None; `encode_prompt` needs neither of these two,
    except that without T5 it sizes zero embeddings from the transformer's config, hence the refusal.
    """
    index = check_sd3_pipeline(path)
    if not (isinstance(index.get("text_encoder_3"), list) and index["text_encoder_3"][0]):
        raise ValueError(f"[model] teacher {path}: model_index.json has no text_encoder_3 (T5); the sd3 family "
                         f"encodes prompts with all three encoders: use the pipeline variant that includes T5")
    from diffusers import StableDiffusion3Pipeline  # slow to import; only encoding needs it

    return StableDiffusion3Pipeline.from_pretrained(str(path), transformer=None, vae=None, dtype=dtype,
                                                    low_cpu_mem_usage=False, use_safetensors=True)

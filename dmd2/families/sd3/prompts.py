"""Prompts for an SD3 teacher: the encoded table, and digests that key a cached table (the prompt file is
read by `prompt_file`, which imports no torch, so the CLI checks it before anything heavy loads).

Encoding is done once, by the pipeline's own text encoders (two CLIPs and a T5), into a table of P
rows; rollouts and records then carry prompt indices (dmd2/families/sd3/conditioning.py). The
digests say when a cached table is still valid: same prompts, negative prompt, sequence length and
text encoder files.
"""

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmd2.families.sd3.pipeline import check_sd3_pipeline
from dmd2.flow_pipeline import files
from dmd2.flow_pipeline.prompts import encode_rows
from dmd2.pipeline_files import CHUNK_BYTES, file_sha256, prompts_digest  # noqa: F401 (re-exported)
from dmd2.prompt_index import ENCODE_BATCH
from dmd2.families.sd3.prompt_file import read_prompts  # noqa: F401 (re-exported: the prompts as read)

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default T5 length
TABLE_KEYS = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds")


def encoder_fingerprint(pipeline_dir: str | Path) -> str:
    """sha256 hex over the text encoders' and tokenizers' files: their classes, and per file its path,
    size and content sha256. Changes whenever anything that shapes a prompt embedding changes."""
    index = check_sd3_pipeline(pipeline_dir)
    return files.components_fingerprint(pipeline_dir, index, files.text_components(index))


def components_fingerprint(pipeline_dir: str | Path, names: list[str]) -> str:
    """sha256 hex over the pipeline's components `names` (e.g. ["vae"]): their classes in model_index.json,
    and per file its path, size and content sha256."""
    return files.components_fingerprint(pipeline_dir, check_sd3_pipeline(pipeline_dir), names)


def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str, batch_size: int = ENCODE_BATCH,
                        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> dict[str, Tensor]:
    """Encode P prompts and the negative prompt with the pipeline's own `encode_prompt`.

    Returns {"prompt_embeds": [P, L, D], "pooled_prompt_embeds": [P, Dp], "negative_prompt_embeds":
    [1, L, D], "negative_pooled_prompt_embeds": [1, Dp]} on CPU, in the encoders' dtype (ceil(P / batch_size)
    calls and one for the negative prompt: dmd2/flow_pipeline/prompts.py `encode_rows`). L = the CLIP tokenizer's
    length (77 for SD3) + max_sequence_length; D = T5's width, the CLIP hidden states (concatenated) zero-padded to
    it; Dp = the two CLIP projections concatenated.
    """
    def encode(batch: list[str]) -> tuple[Tensor, Tensor]:
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=batch, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
        return embeds.cpu(), pooled.cpu()

    return encode_rows(encode, prompts, negative_prompt, ("prompt_embeds", "pooled_prompt_embeds"), batch_size)


def load_text_pipeline(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A `StableDiffusion3Pipeline` holding only the text encoders and tokenizers (no MMDiT, no VAE).

    diffusers skips loading a component passed as None; `encode_prompt` needs neither of these two,
    except that without T5 it sizes zero embeddings from the transformer's config, hence the refusal.
    """
    if not files.present(check_sd3_pipeline(path), "text_encoder_3"):
        raise ValueError(f"[model] teacher {path}: model_index.json has no text_encoder_3 (T5); the sd3 family "
                         f"encodes prompts with all three encoders: use the pipeline variant that includes T5")
    from diffusers import StableDiffusion3Pipeline  # slow to import; only encoding needs it

    return StableDiffusion3Pipeline.from_pretrained(str(path), transformer=None, vae=None, dtype=dtype,
                                                    low_cpu_mem_usage=False, use_safetensors=True)

"""Prompts for a Wan teacher, encoded once by the pipeline's own `encode_prompt` (UMT5; no pooled embedding), and
the key its table is stored under.

As SD3's: P prompts and the negative prompt are encoded on a Ray worker once per prompt set, stored under a digest
of everything an embedding depends on, and rollouts move prompt indices; index -1 (`NEGATIVE`) is the negative
prompt, CFG's negative branch. The table is `dmd2.flow_pipeline.prompts.StatesTable`.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmd2.families.wan.pipeline import check_wan_pipeline
from dmd2.flow_pipeline.prompts import encode_rows
from dmd2.pipeline_files import file_sha256, prompts_digest
from dmd2.prompt_index import ENCODE_BATCH

TEXT_COMPONENTS = ("text_encoder", "tokenizer")


def encoder_fingerprint(pipeline_dir: str | Path, names: tuple[str, ...] = TEXT_COMPONENTS) -> str:
    """sha256 hex over the components `names` of the pipeline: their classes, and per file its path, size and
    content sha256. Changes whenever anything that shapes a prompt embedding changes."""
    pipeline_dir = Path(pipeline_dir)
    index = check_wan_pipeline(pipeline_dir)
    digest = hashlib.sha256()
    for name in names:
        digest.update(json.dumps([name, index.get(name)]).encode())
        for file in sorted(p for p in (pipeline_dir / name).rglob("*") if p.is_file()):
            relative = file.relative_to(pipeline_dir).as_posix()
            digest.update(json.dumps([relative, file.stat().st_size, file_sha256(file)]).encode())
    return digest.hexdigest()


def table_key(prompts: list[str], negative_prompt: str, pipeline_dir: str | Path, max_sequence_length: int,
              dtype: torch.dtype) -> str:
    """The digest naming an encoded table (prompts, negative prompt, encoder files, UMT5 length, dtype)."""
    key = prompts_digest(prompts, negative_prompt, encoder_fingerprint(pipeline_dir), max_sequence_length)
    return hashlib.sha256(f"wan {key} {dtype}".encode()).hexdigest()


def load_text_pipeline(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A WanPipeline holding only UMT5 and its tokenizer (diffusers skips loading a component passed as None)."""
    from diffusers import WanPipeline  # slow to import; only encoding needs it

    check_wan_pipeline(path)
    return WanPipeline.from_pretrained(str(path), transformer=None, transformer_2=None, vae=None, dtype=dtype,
                                       use_safetensors=True)


def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str, max_sequence_length: int,
                        batch_size: int = ENCODE_BATCH) -> dict[str, Tensor]:
    """{"prompt_embeds": [P, L, D], "negative_prompt_embeds": [1, L, D]} on CPU, by `pipeline.encode_prompt`
    (L = max_sequence_length: UMT5's states past a prompt's tokens are zeroed by the pipeline, so a row does not
    depend on its batch)."""
    def encode(batch: list[str]) -> tuple[Tensor]:
        embeds, _ = pipeline.encode_prompt(batch, do_classifier_free_guidance=False,
                                           max_sequence_length=max_sequence_length)
        return (embeds.cpu(),)

    return encode_rows(encode, prompts, negative_prompt, ("prompt_embeds",), batch_size)

"""Prompts for a Wan teacher, encoded once by the pipeline's own `encode_prompt` (UMT5; no pooled embedding), and
the table that turns the prompt indices records carry into the transformer's `encoder_hidden_states`.

As SD3's: P prompts and the negative prompt are encoded on a Ray worker once per prompt set, stored under a digest
of everything an embedding depends on, and rollouts move prompt indices; index -1 (`NEGATIVE`) is the negative
prompt, CFG's negative branch. `dmd2.prompt_index.TableVelocity` expands them.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmd2.families.wan.pipeline import check_wan_pipeline
from dmd2.model import Cond
from dmd2.pipeline_files import file_sha256, prompts_digest
from dmd2.prompt_index import ENCODE_BATCH, NEGATIVE
from dmd2.tensors import is_fake, on_host

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


@torch.no_grad()  # encode_prompt records autograd graphs otherwise
def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str, max_sequence_length: int,
                        batch_size: int = ENCODE_BATCH) -> dict[str, Tensor]:
    """{"prompt_embeds": [P, L, D], "negative_prompt_embeds": [1, L, D]} on CPU, by `pipeline.encode_prompt`
    (L = max_sequence_length: UMT5's states past a prompt's tokens are zeroed by the pipeline, so a row does not
    depend on its batch)."""
    if not prompts:
        raise ValueError("[data] prompts: no prompt to encode; give at least one")

    def encode(batch: list[str]) -> Tensor:
        embeds, _ = pipeline.encode_prompt(batch, do_classifier_free_guidance=False,
                                           max_sequence_length=max_sequence_length)
        return embeds.cpu()

    rows = [encode(prompts[i * batch_size:(i + 1) * batch_size]) for i in range(math.ceil(len(prompts) / batch_size))]
    return {"prompt_embeds": torch.cat(rows), "negative_prompt_embeds": encode([negative_prompt])}


@dataclass(frozen=True)
class WanPromptTable:
    """Encoded prompts: prompt_embeds [P, L, D] and the negative prompt's negative_prompt_embeds [1, L, D] (the
    names of `WanPipeline.encode_prompt`'s outputs)."""

    prompt_embeds: Tensor
    negative_prompt_embeds: Tensor

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "WanPromptTable":
        return cls(tensors["prompt_embeds"], tensors["negative_prompt_embeds"])

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "WanPromptTable":
        return WanPromptTable(self.prompt_embeds.to(device=device, dtype=dtype),
                              self.negative_prompt_embeds.to(device=device, dtype=dtype))

    def cond(self, prompt_index: Tensor) -> Cond:
        """The transformer's conditioning of prompts [B] (int64 in [0, P), or NEGATIVE for the negative prompt)."""
        index = prompt_index.long()
        if index.device.type == "cpu" and not is_fake(index):  # as SD3's table: checked where it costs no GPU sync
            with on_host():
                if bool(((index < NEGATIVE) | (index >= len(self))).any()):
                    raise IndexError(f"a prompt index of {index.tolist()} is outside the table of {len(self)} "
                                     f"prompts (valid: 0..{len(self) - 1}, or {NEGATIVE} for the negative prompt)")
        index = index.to(self.prompt_embeds.device)
        negative = (index == NEGATIVE)[:, None, None]
        embeds = torch.where(negative, self.negative_prompt_embeds, self.prompt_embeds[index.clamp(min=0)])
        return {"encoder_hidden_states": embeds}

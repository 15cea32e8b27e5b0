"""Prompts for a Qwen-Image teacher, encoded once by the pipeline's own `encode_prompt` (Qwen2.5-VL's last hidden
states of the prompt in its chat template, the template's prefix dropped), into a table that prompt indices look up.

Unlike CLIP and T5, Qwen2.5-VL does not pad to a fixed length: a prompt's embedding is as long as its tokens, and the
pipeline pads a batch to its longest prompt with zeros and a mask (`prompt_embeds_mask`). The table pads every row to
its longest the same way; the transformer masks the padding out of attention, and text positions count from the
first token, so a row's padding does not change what the model computes from it.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmd2.flow_pipeline.prompts import encode_rows, lookup
from dmd2.model import Cond
from dmd2.prompt_index import merge_tables


def _padded(embeds: Tensor, mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """A batch of [B, l, D] embeddings and its mask (None: every token valid) padded with zeros to `length`."""
    batch, tokens, width = embeds.shape
    mask = torch.ones(batch, tokens, dtype=torch.long) if mask is None else mask.long().cpu()
    return (torch.cat([embeds.cpu(), embeds.new_zeros(batch, length - tokens, width).cpu()], dim=1),
            torch.cat([mask, mask.new_zeros(batch, length - tokens)], dim=1))


def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str,
                        max_sequence_length: int) -> dict[str, Tensor]:
    """{"prompt_embeds": [P, L, D], "prompt_embeds_mask": [P, L], "negative_prompt_embeds": [1, L, D],
    "negative_prompt_embeds_mask": [1, L]}, L the longest row (at most `max_sequence_length` tokens)."""
    def encode(batch: list[str]) -> tuple[Tensor, Tensor]:
        embeds, mask = pipeline.encode_prompt(batch, max_sequence_length=max_sequence_length)
        return _padded(embeds, mask, max_sequence_length)

    table = encode_rows(encode, prompts, negative_prompt, ("prompt_embeds", "prompt_embeds_mask"))
    length = int(torch.cat([table["prompt_embeds_mask"], table["negative_prompt_embeds_mask"]]).sum(1).max())
    return {name: tensor[:, :length] for name, tensor in table.items()}  # the padding no row needs, cut


def merge_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One table of the parts' rows (`dmd2.prompt_index.merge_tables`), each part padded with zeros from its own
    longest row to the longest of them all: what one encoding of every row makes (it pads to `max_sequence_length`,
    then cuts what no row needs)."""
    parts = [part for part in parts if part]
    length = max(part["prompt_embeds"].shape[1] for part in parts)
    pairs = [("prompt_embeds", "prompt_embeds_mask"), ("negative_prompt_embeds", "negative_prompt_embeds_mask")]
    return merge_tables([{name: tensor.to(part[name].dtype) for embeds, mask in pairs  # the mask in the table's dtype
                          for name, tensor in zip((embeds, mask), _padded(part[embeds], part[mask], length))}
                         for part in parts])


@dataclass(frozen=True)
class QwenPromptTable:
    """Encoded prompts: prompt_embeds [P, L, D] with prompt_embeds_mask [P, L] (1: a token, 0: padding), and the
    negative prompt's negative_prompt_embeds [1, L, D], negative_prompt_embeds_mask [1, L]."""

    prompt_embeds: Tensor
    prompt_embeds_mask: Tensor
    negative_prompt_embeds: Tensor
    negative_prompt_embeds_mask: Tensor

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "QwenPromptTable":
        return cls(**{name: tensors[name] for name in cls.__dataclass_fields__})

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "QwenPromptTable":
        """On another device; `dtype` applies to the embeddings (the masks stay integers)."""
        return QwenPromptTable(self.prompt_embeds.to(device=device, dtype=dtype),
                               self.prompt_embeds_mask.to(device=device, dtype=torch.long),
                               self.negative_prompt_embeds.to(device=device, dtype=dtype),
                               self.negative_prompt_embeds_mask.to(device=device, dtype=torch.long))

    def cond(self, prompt_index: Tensor) -> Cond:
        """The transformer's conditioning of prompts [B] (int64 in [0, P), or NEGATIVE for the negative prompt):
        `encoder_hidden_states` [B, L, D] and `encoder_hidden_states_mask` [B, L] (bool)."""
        rows, negative = lookup(prompt_index, len(self), self.prompt_embeds.device)
        embeds = torch.where(negative[:, None, None], self.negative_prompt_embeds, self.prompt_embeds[rows])
        mask = torch.where(negative[:, None], self.negative_prompt_embeds_mask, self.prompt_embeds_mask[rows])
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask.bool()}

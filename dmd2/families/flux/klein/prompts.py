"""Prompts for a FLUX.2 [klein] teacher, encoded once by the pipeline's own `encode_prompt` into a table that prompt
indices look up.

`Flux2KleinPipeline.encode_prompt` runs Qwen3 on the prompt in its chat template, padded to `max_sequence_length`
tokens, and stacks the hidden states of layers (9, 18, 27) per token: [P, L, 3 D], no pooled vector, and no mask (the
transformer attends to the padding's states too, as the pipeline feeds them). Every row has the same length, so the
table is one tensor per name, its parts concatenated as they are.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmd2.flow_pipeline.prompts import check_indices, encode_rows
from dmd2.model import Cond
from dmd2.prompt_index import NEGATIVE


def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str,
                        max_sequence_length: int) -> dict[str, Tensor]:
    """{"prompt_embeds": [P, L, D], "negative_prompt_embeds": [1, L, D]}, L = `max_sequence_length` (its `text_ids`
    are the token positions, made again per call)."""
    def encode(batch: list[str]) -> tuple[Tensor]:
        embeds, _ = pipeline.encode_prompt(batch, max_sequence_length=max_sequence_length)
        return (embeds.cpu(),)

    return encode_rows(encode, prompts, negative_prompt, ("prompt_embeds",))


@dataclass(frozen=True)
class KleinPromptTable:
    """Encoded prompts: prompt_embeds [P, L, D] and the negative prompt's negative_prompt_embeds [1, L, D]."""

    prompt_embeds: Tensor
    negative_prompt_embeds: Tensor

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "KleinPromptTable":
        return cls(tensors["prompt_embeds"], tensors["negative_prompt_embeds"])

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KleinPromptTable":
        return KleinPromptTable(self.prompt_embeds.to(device=device, dtype=dtype),
                                self.negative_prompt_embeds.to(device=device, dtype=dtype))

    def cond(self, prompt_index: Tensor) -> Cond:
        """The transformer's `encoder_hidden_states` [B, L, D] of prompts [B] (int64 in [0, P), or NEGATIVE)."""
        index = prompt_index.long()
        check_indices(index, len(self))
        device = self.prompt_embeds.device
        rows, negative = index.clamp(min=0).to(device), (index == NEGATIVE).to(device)
        # `torch.where`, not a boolean-mask assignment: that one waits for the GPU
        embeds = torch.where(negative[:, None, None], self.negative_prompt_embeds, self.prompt_embeds[rows])
        return {"encoder_hidden_states": embeds}

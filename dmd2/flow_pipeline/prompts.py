"""Prompts encoded once by the pipeline's own `encode_prompt` into a table of P rows plus the negative prompt's, and
the lookup that turns the prompt indices records carry (dmd2/prompt_index.py) into a transformer's conditioning.

`PromptTable` is the layout of the pipelines whose text conditioning is a token sequence and a pooled vector (SD3's
CLIPs and T5, FLUX's CLIP and T5): `encode_prompt`'s `prompt_embeds` [P, L, D] and `pooled_prompt_embeds` [P, Dp],
expanded into `encoder_hidden_states` and `pooled_projections`, the keyword arguments of both transformers.
`StatesTable` is theirs whose text conditioning is the token sequence alone (Wan's UMT5, FLUX.2 [klein]'s Qwen3).
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dmd2.model import Cond
from dmd2.prompt_index import ENCODE_BATCH, NEGATIVE
from dmd2.tensors import is_fake, on_host

Encode = Callable[[list[str]], tuple[Tensor, ...]]  # prompts -> the pipeline's embeddings of them, on CPU


def check_indices(index: Tensor, size: int) -> None:
    """Refuse prompt indices outside a table of `size` prompts, where that costs no GPU synchronisation."""
    if index.device.type == "cpu" and not is_fake(index):  # `dmd2 plan`'s fake ones hold no values to check
        # Indices made on the host are checked there (`on_host`); on a GPU the check would synchronize every
        # model call (one out of range there still fails in the lookup).
        with on_host():
            bad = (index < NEGATIVE) | (index >= size)
            if bad.any():
                raise IndexError(f"prompt index {index[bad][0].item()} is outside the table of {size} "
                                 f"prompts (valid: 0..{size - 1}, or {NEGATIVE} for the negative prompt)")


def lookup(prompt_index: Tensor, size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The table rows of prompts [B] (int64 in [0, size), or NEGATIVE) and where the negative prompt's are [B] (bool),
    checked (`check_indices`), on the table's ``device``. A table picks with `torch.where`, not a boolean-mask
    assignment: that one waits for the GPU."""
    index = prompt_index.long()
    check_indices(index, size)
    return index.clamp(min=0).to(device), (index == NEGATIVE).to(device)


@torch.no_grad()  # encode_prompt itself records autograd graphs
def encode_rows(encode: Encode, prompts: list[str], negative_prompt: str, names: tuple[str, ...],
                batch_size: int = ENCODE_BATCH) -> dict[str, Tensor]:
    """The table {name: [P, ...]} of P prompts, and {"negative_" + name: [1, ...]} of the negative prompt, from
    `encode` (the pipeline's `encode_prompt`, its outputs named `names`). The prompts go in batches of `batch_size` and
    the negative prompt as its own row: every encoder pads to a fixed length, so a row does not depend on its batch."""
    if not prompts:
        raise ValueError("[data] prompts: no prompt to encode; give at least one")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches = [encode(prompts[i * batch_size:(i + 1) * batch_size])
               for i in range(math.ceil(len(prompts) / batch_size))]
    negative = encode([negative_prompt])
    table = {name: torch.cat([batch[k] for batch in batches]) for k, name in enumerate(names)}
    return table | {f"negative_{name}": negative[k] for k, name in enumerate(names)}


@dataclass(frozen=True)
class PromptTable:
    """Encoded prompts: prompt_embeds [P, L, D], pooled_prompt_embeds [P, Dp], and the negative prompt's
    negative_prompt_embeds [1, L, D], negative_pooled_prompt_embeds [1, Dp] (the names of `encode_prompt`'s
    outputs)."""

    prompt_embeds: Tensor
    pooled_prompt_embeds: Tensor
    negative_prompt_embeds: Tensor
    negative_pooled_prompt_embeds: Tensor

    def __post_init__(self):
        count, length, width = self.prompt_embeds.shape
        expected = {"pooled_prompt_embeds": (count, self.pooled_prompt_embeds.shape[-1]),
                    "negative_prompt_embeds": (1, length, width),
                    "negative_pooled_prompt_embeds": (1, self.pooled_prompt_embeds.shape[-1])}
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"PromptTable: {name} has shape {tuple(getattr(self, name).shape)}, expected "
                                 f"{shape} for prompt_embeds of shape {(count, length, width)}; build the table "
                                 f"with encode_prompt_table")

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "PromptTable":
        """From `encode_prompt_table`'s dict (or a safetensors file of it)."""
        return cls(**{name: tensors[name] for name in cls.__dataclass_fields__})

    def tensors(self) -> dict[str, Tensor]:
        """The four tensors by name (to save, e.g. with safetensors)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "PromptTable":
        """The table on another device or in another dtype (e.g. next to the model, once per run)."""
        return PromptTable(**{name: t.to(device=device, dtype=dtype) for name, t in self.tensors().items()})

    def cond(self, prompt_index: Tensor) -> Cond:
        """The transformer's conditioning of prompts [B] (int64 in [0, P), or NEGATIVE for the negative prompt)."""
        rows, negative = lookup(prompt_index, len(self), self.prompt_embeds.device)
        embeds = torch.where(negative[:, None, None], self.negative_prompt_embeds, self.prompt_embeds[rows])
        pooled = torch.where(negative[:, None], self.negative_pooled_prompt_embeds, self.pooled_prompt_embeds[rows])
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def neg_cond(self, n: int) -> Cond:
        """The negative prompt's conditioning for n samples (views of the one row: no copies)."""
        return {"encoder_hidden_states": self.negative_prompt_embeds.expand(n, -1, -1),
                "pooled_projections": self.negative_pooled_prompt_embeds.expand(n, -1)}


@dataclass(frozen=True)
class StatesTable:
    """Encoded prompts of a text encoder with no pooled vector: prompt_embeds [P, L, D] and the negative prompt's
    negative_prompt_embeds [1, L, D] (the names of the pipelines' `encode_prompt` outputs)."""

    prompt_embeds: Tensor
    negative_prompt_embeds: Tensor

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "StatesTable":
        return cls(tensors["prompt_embeds"], tensors["negative_prompt_embeds"])

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "StatesTable":
        return StatesTable(self.prompt_embeds.to(device=device, dtype=dtype),
                           self.negative_prompt_embeds.to(device=device, dtype=dtype))

    def cond(self, prompt_index: Tensor) -> Cond:
        """The transformer's `encoder_hidden_states` [B, L, D] of prompts [B] (int64 in [0, P), or NEGATIVE)."""
        rows, negative = lookup(prompt_index, len(self), self.prompt_embeds.device)
        embeds = torch.where(negative[:, None, None], self.negative_prompt_embeds, self.prompt_embeds[rows])
        return {"encoder_hidden_states": embeds}

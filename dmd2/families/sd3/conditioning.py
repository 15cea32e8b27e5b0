"""SD3 conditioning by prompt index: records carry `{"prompt_index": [B] int64}`, never embeddings.

A `PromptTable` holds the encoded prompts (dmd2/families/sd3/prompts.py: `encode_prompt_table`); it
expands indices into the keyword arguments of `SD3Transformer2DModel.forward`
(`encoder_hidden_states` [B, L, D], `pooled_projections` [B, Dp]), so that
`dmd2.model.DiffusersVelocity(transformer)(x_s, sigma, table.cond(index))` is the velocity.
`TableVelocity` does that expansion inside a `VelocityFn`, so the algorithm (rollout, CFG via
`dmd2.model.guided`, critic and actor steps) moves small index tensors around. The index
`NEGATIVE` (-1) stands for the negative prompt: CFG's negative branch is `negative_indices(B)`.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.model import Cond
from dmd2.prompt_index import INDEX_KEY, NEGATIVE, TableVelocity, negative_indices, prompt_indices  # noqa: F401
from dmd2.tensors import is_fake, on_host


@dataclass(frozen=True)
class PromptTable:
    """Encoded prompts: prompt_embeds [P, L, D], pooled_prompt_embeds [P, Dp], and the negative prompt's
    negative_prompt_embeds [1, L, D], negative_pooled_prompt_embeds [1, Dp] (the names of
    `StableDiffusion3Pipeline.encode_prompt`'s outputs)."""

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
        index = prompt_index.long()
        if index.device.type == "cpu" and not is_fake(index):  # `dmd2 plan`'s fake ones hold no values to check
            # Indices made on the host are checked there (`on_host`); on a GPU the check would synchronize every
            # model call (one out of range there still fails in the lookup).
            with on_host():
                bad = (index < NEGATIVE) | (index >= len(self))
                if bad.any():
                    raise IndexError(f"prompt index {index[bad][0].item()} is outside the table of {len(self)} "
                                     f"prompts (valid: 0..{len(self) - 1}, or {NEGATIVE} for the negative prompt)")
        device = self.prompt_embeds.device
        rows, negative = index.clamp(min=0).to(device), (index == NEGATIVE).to(device)
        # The negative prompt's rows by `torch.where`, not a boolean-mask assignment: that one waits for the GPU.
        embeds = torch.where(negative[:, None, None], self.negative_prompt_embeds, self.prompt_embeds[rows])
        pooled = torch.where(negative[:, None], self.negative_pooled_prompt_embeds, self.pooled_prompt_embeds[rows])
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def neg_cond(self, n: int) -> Cond:
        """The negative prompt's conditioning for n samples (views of the one row: no copies)."""
        return {"encoder_hidden_states": self.negative_prompt_embeds.expand(n, -1, -1),
                "pooled_projections": self.negative_pooled_prompt_embeds.expand(n, -1)}



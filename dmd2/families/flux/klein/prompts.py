"""Prompts for a FLUX.2 [klein] teacher, encoded once by the pipeline's own `encode_prompt` into a table that prompt
indices look up.

`Flux2KleinPipeline.encode_prompt` runs Qwen3 on the prompt in its chat template, padded to `max_sequence_length`
tokens, and stacks the hidden states of layers (9, 18, 27) per token: [P, L, 3 D], no pooled vector, and no mask (the
transformer attends to the padding's states too, as the pipeline feeds them). Every row has the same length, so the
table is one tensor per name, its parts concatenated as they are.
"""

from typing import Any

from torch import Tensor

from dmd2.flow_pipeline.prompts import encode_rows


def encode_prompt_table(pipeline: Any, prompts: list[str], negative_prompt: str,
                        max_sequence_length: int) -> dict[str, Tensor]:
    """{"prompt_embeds": [P, L, D], "negative_prompt_embeds": [1, L, D]}, L = `max_sequence_length` (its `text_ids`
    are the token positions, made again per call)."""
    def encode(batch: list[str]) -> tuple[Tensor]:
        embeds, _ = pipeline.encode_prompt(batch, max_sequence_length=max_sequence_length)
        return (embeds.cpu(),)

    return encode_rows(encode, prompts, negative_prompt, ("prompt_embeds",))


"""Conditioning by prompt index, for families whose prompts are encoded once into a table: records and rollouts
carry `{"prompt_index": [B] int64}`, never embeddings; the index `NEGATIVE` (-1) is the negative prompt, CFG's
negative branch. A family's table (anything with `cond(prompt_index) -> Cond`) expands indices into its model's
keyword arguments inside a `TableVelocity`, so the algorithm moves small index tensors around.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.config import DistillConfig
from dmd2.draws import RolloutDraws
from dmd2.model import Cond, VelocityFn

NEGATIVE = -1  # the prompt index of the negative prompt
INDEX_KEY = "prompt_index"


def prompt_indices(prompt_index: Tensor) -> Cond:
    """The index conditioning of prompts [B] (what records and rollouts carry)."""
    return {INDEX_KEY: prompt_index.long()}


def negative_indices(n: int) -> Cond:
    """The index conditioning of n samples of the negative prompt: CFG's `neg_cond`."""
    return {INDEX_KEY: torch.full((n,), NEGATIVE, dtype=torch.long)}


class TableVelocity:
    """A VelocityFn over index conditionings: v(x_s, sigma, {"prompt_index": [B]}) =
    velocity_fn(x_s, sigma, table.cond(prompt_index)), the embeddings moved to x_s's device and dtype."""

    def __init__(self, velocity_fn: VelocityFn, table):  # table: any with `cond(prompt_index) -> Cond`
        self.velocity_fn = velocity_fn
        self.table = table

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        if set(cond) != {INDEX_KEY}:
            raise ValueError(f"TableVelocity takes the conditioning {{{INDEX_KEY!r}: [B] int64}}, got keys "
                             f"{sorted(cond)}; build it with prompt_indices / negative_indices")
        expanded = self.table.cond(cond[INDEX_KEY])
        expanded = {key: value.to(device=x_s.device, dtype=x_s.dtype) for key, value in expanded.items()}
        return self.velocity_fn(x_s, sigma, expanded)


@dataclass(frozen=True)
class PromptIndices:
    """A CondSource: uniform prompt indices in [0, num_prompts); CFG's negative is the negative prompt."""

    num_prompts: int

    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Cond, Cond]:
        return prompt_indices(draws.integers("cond", self.num_prompts, rows)), negative_indices(len(rows))


def table_dtype(config: DistillConfig) -> torch.dtype:
    """The prepared prompt table's dtype: bf16 under `[train] mixed_precision = "bf16"`, half the bytes of fp32 on
    every node, and the same model calls: every model takes the embeddings first into a layer that computes in bf16
    (autocast, or the teacher's bf16 weights), which rounds fp32 ones to exactly these values."""
    return torch.bfloat16 if config.train.mixed_precision == "bf16" else torch.float32


ENCODE_BATCH = 8  # prompts per text-encoder call; parts of a table (`table_part`) are whole batches of it
NEGATIVE_PREFIX = "negative_"  # a table's tensors of the negative prompt's one row


def table_part(rows: list[str], part: tuple[int, int]) -> list[str]:
    """Part i of n of a prompt table's ``rows``, which one worker encodes (`ModelFamily.prepare`): whole encoder
    batches, so each row is encoded in the very batch one encoding of every row puts it in, as evenly as the batches
    divide (the last parts are empty when there are fewer batches than parts)."""
    index, count = part
    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}: expected 0 <= part < count")
    base, extra = divmod(-(-len(rows) // ENCODE_BATCH), count)  # the first `extra` parts take one batch more
    start, stop = ((at * base + min(at, extra)) * ENCODE_BATCH for at in (index, index + 1))
    return rows[start:stop]


def merge_tables(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One prompt table of the parts' rows, in order: what one encoding of every row makes. Every part encodes the
    negative prompt's row (`NEGATIVE_PREFIX`); the first's is kept. Empty parts (no rows) are skipped."""
    parts = [part for part in parts if part]
    if not parts:
        raise ValueError("no part of the prompt table holds a row")
    return {name: tensor if name.startswith(NEGATIVE_PREFIX) else torch.cat([part[name] for part in parts])
            for name, tensor in parts[0].items()}

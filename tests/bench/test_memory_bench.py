"""bench/memory.py on the tests' tiny MMDiT: FSDP2 over a fake process group of 2 ranks, on fake tensors.
What one rank holds is checked against an independent count of its shards: FSDP2 splits each parameter's
first dimension over the ranks (padded to equal parts) and leaves buffers whole; AdamW keeps two moments
of each shard and a step count."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.memory import Layout, measure, on_meta
from dmd2.memory import BLOCK_BYTES, block_bytes
from tests.dmd2.families.sd3.tiny_pipeline import TINY_TRANSFORMER

WORLD = 2


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def shard_bytes(param: torch.nn.Parameter) -> int:
    rows = math.ceil(param.shape[0] / WORLD) if param.dim() else 1
    return block_bytes(rows * math.prod(param.shape[1:]) * param.element_size())


def test_one_rank_holds_its_shards_their_moments_and_whole_buffers(fake_group):
    figures = measure(TINY_TRANSFORMER, Layout(bf16=False, sharded=True, checkpointing=False), WORLD, batch=2,
                      resolution=64)
    model = on_meta(TINY_TRANSFORMER)
    params, buffers = list(model.parameters()), list(model.buffers())
    shards = sum(shard_bytes(p) for p in params)
    whole_buffers = sum(block_bytes(b.numel() * b.element_size()) for b in buffers)
    train = figures["rows"]["train"]
    assert train["weights"] == shards + whole_buffers
    assert train["optimizer"] == sum(2 * shard_bytes(p) + BLOCK_BYTES for p in params)
    assert figures["parameters"] == sum(p.numel() for p in params)
    # Scoring adds the teacher sharded like the critic (fp32 here), beside the critic's sharded state.
    score = figures["rows"]["score"]
    assert score["teacher"] == shards + whole_buffers
    assert score["weights"] == train["weights"] and score["peak"] >= score["teacher"] + score["weights"]
    assert figures["peak"] == max(row["peak"] for row in figures["rows"].values())


def test_a_layout_that_is_not_one_is_refused():
    with pytest.raises(SystemExit, match="'<fp32|bf16> <ddp|fsdp> \\[ac\\]'"):
        Layout.parse("bf16 zero3")

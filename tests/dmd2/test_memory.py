"""dmd2/memory.py: the memory ledger measures a training step alike on real and on fake tensors, agrees with
torch's own memory tracker, and splits the peak into categories that independent counts confirm."""

import contextlib

import pytest
import torch
from diffusers import UNet2DModel
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from dmd2.memory import BLOCK_BYTES, CATEGORIES, MemoryLedger, block_bytes

CONFIG = dict(sample_size=16, in_channels=1, out_channels=1, block_out_channels=(32, 64), layers_per_block=1,
              down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
              norm_num_groups=8)
BATCH = 8


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, t = torch.randn(BATCH, 1, 16, 16), torch.rand(BATCH) * 1000
    model(x, t).sample.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measured(fake: bool) -> list:
    """Two training steps (the first makes AdamW's moments) under the ledger, on fake or real tensors."""
    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:  # as a planner builds a model no machine holds: on the meta device, then fake storage
        with torch.device("meta"):
            model = UNet2DModel(**CONFIG)
    else:
        model = UNet2DModel(**CONFIG)
    ledger = MemoryLedger()
    with mode:
        if fake:
            model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with ledger:
            ledger.label(model, "weights")
            for step in range(2):
                with ledger.stage(f"step {step}"):
                    train_step(model, optimizer)
    return ledger.peaks, model


def test_fake_tensors_give_the_peaks_real_tensors_give():
    real, _ = measured(fake=False)
    fake, _ = measured(fake=True)
    assert [(p.stage, p.peak, p.by_category) for p in fake] == [(p.stage, p.peak, p.by_category) for p in real]


def test_the_peak_is_within_a_few_percent_of_torchs_memory_tracker_on_real_tensors():
    peaks, _ = measured(fake=False)
    torch.manual_seed(0)
    model = UNet2DModel(**CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        train_step(model, optimizer)
        tracker.reset_mod_stats()
        train_step(model, optimizer)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peaks[1].peak == pytest.approx(theirs, rel=0.02)


def test_the_categories_match_independent_counts():
    peaks, model = measured(fake=False)
    params = list(model.parameters())
    weights = sum(block_bytes(p.numel() * p.element_size()) for p in [*params, *model.buffers()])
    # AdamW: two fp32 moments per parameter, and a scalar step count (one allocator block each).
    moments = sum(2 * block_bytes(p.numel() * p.element_size()) + BLOCK_BYTES for p in params)
    first, second = peaks
    assert set(first.by_category) == set(CATEGORIES)
    assert first.by_category["weights"] == second.by_category["weights"] == weights
    assert first.by_category["optimizer"] == 0 and second.by_category["optimizer"] == moments
    # The peak is the end of the forward: every activation backward needs, none freed yet.
    assert first.by_category["activations"] > 0
    assert sum(second.by_category.values()) == second.peak


def test_a_resized_storage_is_counted_at_its_new_size():
    ledger, resize = MemoryLedger(), torch.UntypedStorage.resize_
    with ledger:
        tensor = torch.empty(1000)
        before = ledger.total
        tensor.untyped_storage().resize_(0)  # how FSDP2 frees its gathered weights
        assert ledger.total == before - block_bytes(4000)
        tensor.untyped_storage().resize_(8000)
        assert ledger.total == before - block_bytes(4000) + block_bytes(8000)
    assert torch.UntypedStorage.resize_ is resize  # the ledger's wrapper is gone with it


def test_an_unknown_category_is_refused():
    with pytest.raises(ValueError, match="unknown memory category 'weight'"):
        MemoryLedger().label([torch.zeros(1)], "weight")

"""Where a stage's memory goes: the bytes of every live tensor storage, by what it holds, and their peak.

`MemoryLedger` watches every operator (a `TorchDispatchMode`), so it measures real tensors and fake ones alike
(`torch._subclasses.FakeTensorMode`): a stage can be measured at a model size no machine at hand could hold.
It is the cheap cousin of torch's `torch.distributed._tools.mem_tracker.MemTracker`, which refreshes a
per-module peak on every operator (over 80% of a fake SD3.5 training step's time went there) where this keeps
one running total per category and recounts only when the total grows by a step.

Categories: `weights` (the trained model's parameters and buffers, as registered with `label`), `gradients`
(their `.grad`, found at each recount), `optimizer` (what an optimizer step allocates: AdamW's moments),
`teacher` and `conditioning` (registered with `label`), `activations` (what a forward with grad enabled
allocates and backward has not yet freed) and `temporaries` (everything else: backward's intermediates,
no-grad forwards, gathered FSDP weights). Sizes round up to the CUDA caching allocator's 512-byte blocks.
What a group parks in host memory while it sleeps (`park`, `unpark`) leaves the device's totals meanwhile.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed._tools.common_utils import get_untyped_storages as storages  # DTensors: their shards'
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("weights", "gradients", "optimizer", "teacher", "conditioning", "activations", "temporaries")
BLOCK_BYTES = 512  # the CUDA caching allocator's smallest block: what a storage really takes
RECOUNT_STEP = 1.005  # recount the categories when the total passes the last recount's by 0.5%


def block_bytes(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclass(frozen=True)
class StagePeak:
    """A stage's peak bytes, and how they split over `CATEGORIES` at (within 0.5% of) the peak."""

    stage: str
    peak: int
    by_category: dict[str, int] = field(default_factory=dict)


class MemoryLedger(TorchDispatchMode):
    """Live storage bytes by category while it is entered; `stage(name)` records a block's peak.

    Register what exists before the block with `label` (weights, teacher, conditioning); what the block
    allocates is labelled by when it was made (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._entries = WeakIdKeyDictionary()  # storage -> [nbytes, category, parked]
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.parked = 0  # bytes parked in host memory (`park`), not on the device
        self.peaks: list[StagePeak] = []
        self._peak = self._recounted = 0
        self._at_peak: dict[str, int] = {}
        self._in_optimizer_step = False
        self._trained: list[nn.Module] = []
        self._handles: list = []
        self._resize = None

    # -- what exists already ---------------------------------------------------------------------------

    def label(self, tensors: Iterable[Tensor] | nn.Module, category: str) -> None:
        """Count ``tensors`` (a module: its parameters and buffers) under ``category`` from now on. A module
        labelled ``weights`` is the trained one: its parameters' gradients are counted as ``gradients``."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; one of {CATEGORIES}")
        if isinstance(tensors, nn.Module):
            if category == "weights":
                self._trained.append(tensors)
            tensors = [*tensors.parameters(), *tensors.buffers()]
        for tensor in tensors:
            for storage in storages(tensor):
                self._add(storage, category, relabel=True)

    def park(self, tensors: Iterable[Tensor]) -> None:
        """``tensors`` move to host memory, as a sleeping group's do: they stop counting on the device."""
        for entry in self._entries_of(tensors):
            if not entry[2]:
                entry[2] = True
                self._grow(-entry[0], entry[1])
                self.parked += entry[0]

    def unpark(self, tensors: Iterable[Tensor]) -> None:
        """``tensors`` come back to the device (a group wakes)."""
        for entry in self._entries_of(tensors):
            if entry[2]:
                entry[2] = False
                self.parked -= entry[0]
                self._grow(entry[0], entry[1])

    def _entries_of(self, tensors: Iterable[Tensor]) -> Iterator[list]:
        seen = set()
        for tensor in tensors:
            for storage in storages(tensor):
                entry = self._entries.get(storage)
                if entry is not None and id(entry) not in seen:
                    seen.add(id(entry))
                    yield entry

    # -- stages ----------------------------------------------------------------------------------------

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Record the peak of the block as ``StagePeak(name, ...)`` in ``peaks``."""
        self._peak = self._recounted = self.total
        self._at_peak = self._recount()
        try:
            yield
        finally:
            breakdown = dict(self._at_peak)
            breakdown["temporaries"] += self._peak - sum(breakdown.values())  # the last 0.5% since the recount
            self.peaks.append(StagePeak(name, self._peak, breakdown))

    # -- bookkeeping -----------------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage, category: str, relabel: bool = False) -> None:
        entry = self._entries.get(storage)
        if entry is not None:
            if relabel and entry[1] != category:
                if not entry[2]:
                    self.totals[entry[1]] -= entry[0]
                    self.totals[category] += entry[0]
                entry[1] = category
            return
        nbytes = block_bytes(storage.nbytes())
        entry = [nbytes, category, False]  # bytes, category, parked
        self._entries[storage] = entry
        weakref.finalize(storage, self._free, entry)
        self._grow(nbytes, category)

    def _free(self, entry: list) -> None:
        if entry[2]:
            self.parked -= entry[0]
            return
        self.totals[entry[1]] -= entry[0]
        self.total -= entry[0]

    def _grow(self, nbytes: int, category: str) -> None:
        self.totals[category] += nbytes
        self.total += nbytes
        if self.total > self._peak:
            self._peak = self.total
            if self.total > self._recounted * RECOUNT_STEP:
                self._recounted, self._at_peak = self.total, self._recount()

    def _recount(self) -> dict[str, int]:
        """The totals by category now, with the trained models' gradients moved to ``gradients``."""
        for model in self._trained:
            for param in model.parameters():
                if param.grad is not None:
                    for storage in storages(param.grad):
                        if storage in self._entries:
                            self._add(storage, "gradients", relabel=True)
        return dict(self.totals)

    def _category_of_new(self) -> str:
        if self._in_optimizer_step:
            return "optimizer"
        in_backward = torch._C._current_graph_task_id() != -1
        return "activations" if torch.is_grad_enabled() and not in_backward else "temporaries"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self._category_of_new()
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor):
                for storage in storages(tensor):
                    self._add(storage, category)
        return out

    def __enter__(self) -> MemoryLedger:
        def before_step(*_):
            self._in_optimizer_step = True

        def after_step(*_):
            self._in_optimizer_step = False

        self._handles = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
        resize, ledger = torch.UntypedStorage.resize_, self

        def tracked_resize(storage, size):  # FSDP2 grows and frees its gathered weights by resizing
            resize(storage, size)
            entry = ledger._entries.get(storage)
            if entry is not None:
                nbytes = block_bytes(storage.nbytes())
                change, entry[0] = nbytes - entry[0], nbytes
                if entry[2]:
                    ledger.parked += change
                else:
                    ledger._grow(change, entry[1])  # a shrink is a negative growth: it never sets a peak
            return storage

        self._resize, torch.UntypedStorage.resize_ = resize, tracked_resize
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        torch.UntypedStorage.resize_ = self._resize
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc_info)

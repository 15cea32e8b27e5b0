"""Sleep and wake: a rank's tensors leave the accelerator and come back bit-identical.

The tensors keep their identity: each storage is copied to host memory (pinned on CUDA, so the copy
back is fast) and shrunk to zero bytes, and on wake regrown and refilled. Swapping `param.data` to
another device instead would reset autograd's gradient accumulators, which DDP hooks into, and
silently stop gradient averaging. Gradients are dropped: every optimizer step starts from
``zero_grad(set_to_none=True)``, so none survives into the next step anyway.
"""

import logging
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmd2.trainer import TrainState

logger = logging.getLogger(__name__)


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor over a whole storage (works for any dtype)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def local(tensor: Tensor) -> Tensor:
    """The rank's own part of a tensor: a DTensor's local shard (FSDP2), else the tensor itself.

    FSDP2's shard is a view into its padded flat storage, so parking that storage parks the shard.
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def module_tensors(module: nn.Module) -> list[Tensor]:
    """Parameters and buffers of ``module``, shard-wise (gradients are dropped, see the module docstring)."""
    for param in module.parameters():
        param.grad = None
    return [local(tensor) for tensor in [*module.parameters(), *module.buffers()]]


def own_storage(module: nn.Module) -> nn.Module:
    """Give every parameter and buffer a storage of its own, which `HostCopy` can shrink and regrow.

    Weights loaded from safetensors may live in file mappings that cannot be resized. Call before
    wrapping the module (DDP) or building its optimizer: it swaps `.data` on the same device.
    """
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.untyped_storage().resizable():
            tensor.data = tensor.data.clone()
    return module


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor of the optimizer's per-parameter state (AdamW: step, exp_avg, exp_avg_sq)."""
    return [local(value) for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]


def sleeping_tensors(module: nn.Module, state: TrainState) -> list[Tensor]:
    """What a group's sleep parks: its model's weights, optimizer state and EMA (gradients are dropped first). The
    rank's sleep and `dmd2 plan`'s rehearsal of it (infra/trainers/memory_plan.py) both park these."""
    state.optimizer.zero_grad(set_to_none=True)  # the next step recomputes them: nothing to keep
    ema = state.ema.local_tensors() if state.ema is not None else []
    return module_tensors(module) + optimizer_tensors(state.optimizer) + ema


class HostCopy:
    """The storages of some tensors, parked in host memory between `offload` and `restore`."""

    def __init__(self) -> None:
        self._parked: list[tuple[torch.UntypedStorage, Tensor]] = []

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Copy each distinct storage to host and free it on its device; returns the bytes moved.

        The copies to pinned memory are issued together and waited for once, before any device memory is freed.
        Pinned buffers come from torch's caching host allocator, so a group's next sleep reuses the last one's.
        The device's cache is not emptied: rank i of every group shares one process (infra/trainers/group.py),
        so the other group allocates from the blocks freed here (and torch frees cached blocks and retries
        before it reports out of memory)."""
        if self._parked:
            raise RuntimeError("already offloaded: restore() before offloading again")
        seen: set[int] = set()
        copies = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # shared storages (tied weights, views) are parked once
            if not storage.resizable():  # nothing is freed yet: the copies so far are simply dropped
                raise RuntimeError(f"a {tuple(tensor.shape)} {tensor.dtype} tensor has a fixed-size storage (a file "
                                   "mapping, or exported with .numpy()) and cannot be offloaded: load weights with "
                                   "own_storage() and export copies only")
            seen.add(storage.data_ptr())
            source = _bytes_of(storage)
            pinned = source.is_cuda and torch.cuda.is_available()
            copies.append((storage, torch.empty(source.shape, dtype=torch.uint8, pin_memory=pinned)
                           .copy_(source, non_blocking=pinned)))
        if any(storage.device.type == "cuda" for storage, _ in copies):
            torch.cuda.synchronize()  # every copy has landed before its device memory is freed
        for storage, _ in copies:
            storage.resize_(0)
        self._parked = copies
        return sum(host.numel() for _, host in copies)

    def restore(self) -> None:
        """Regrow every parked storage on its device and copy its bytes back."""
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=host.is_pinned())
        if any(storage.device.type == "cuda" for storage, _ in self._parked):
            torch.cuda.synchronize()  # the host copies may be freed only once the copies landed
        self._parked = []

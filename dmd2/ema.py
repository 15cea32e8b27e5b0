"""An exponential moving average (EMA) of the student's trainable parameters, for evaluation and export.

After every optimizer step of the student (`dmd2.trainer.train_steps`):

    ema <- decay * ema + (1 - decay) * param        (ema starts as the initial weights)

The student trains on its own weights; the average only follows them. It smooths out the last
~1 / (1 - decay) steps' noise, which the raw weights of a generator trained on a moving critic carry.
Under FSDP2 a parameter is a DTensor; each rank averages its own shard (the update is elementwise, so
it needs no communication), and its average is a DTensor sharded alike (a checkpoint reshards it).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (a view: writes land in the parameter), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ParameterEMA:
    """The EMA of `model`'s parameters that require grad now, held beside them on their device."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"an EMA's decay must be in [0, 1), got {decay}")
        self.decay = decay
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        self._params = [param for _, param in named]
        with torch.no_grad():
            self._averages = {name: param.detach().clone() for name, param in named}

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step: lerp(ema, param, 1 - decay) = ema + (1 - decay) (param - ema)."""
        torch._foreach_lerp_(self.local_tensors(), [_local(p) for p in self._params], 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """The average restarts at the parameters' current values (e.g. a checkpoint that has none)."""
        for average, param in zip(self.local_tensors(), self._params):
            average.copy_(_local(param))

    def state_dict(self) -> dict[str, Tensor]:
        """The averages by parameter name: the tensors themselves, so a checkpoint loads into them in place."""
        return self._averages

    def local_tensors(self) -> list[Tensor]:
        """This rank's part of every average (what sleep parks off the accelerator)."""
        return [_local(average) for average in self._averages.values()]

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the averages inside the block, and its own weights again after it, bitwise.

        Swapped in place one tensor at a time, so the model's other references (the optimizer, DDP's
        hooks, FSDP2's shards) stay valid and the peak extra memory is one parameter, not a model."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for param, average in zip(self._params, self.local_tensors()):
            param = _local(param)
            held = param.clone()
            param.copy_(average)
            average.copy_(held)

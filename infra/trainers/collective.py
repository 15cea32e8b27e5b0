"""Decisions every rank of a group makes alike, so that no rank is left waiting in a collective.

A rank that raises while its peers go on to an all-reduce or a broadcast leaves them blocked until
the process group's timeout (minutes). Work whose failure is possible on one rank alone (reading its
inputs, writing its checkpoint part, rank 0's evaluation) therefore runs through `on_every_rank` or
`on_rank0`: the outcome is exchanged, and if any rank failed, every rank raises.

Errors travel between ranks pickled (torch.distributed's object collectives, rank to rank, never
through the store); one that does not pickle travels as a `RuntimeError` with its text.
"""

import pickle
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


def _portable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _outcome(work: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return work(), None
    except Exception as raised:
        return None, raised


def _exchanged(outcome: tuple[Any, BaseException | None], group: dist.ProcessGroup | None) -> list[tuple]:
    """Every rank's (result, error), by rank; raises on every rank if any rank failed (a failing rank its own
    error, the others the first failing rank's)."""
    result, error = outcome
    outcomes = [(result, _portable(error))]
    if dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (result, _portable(error)), group=group)
    error = error or next((e for _, e in outcomes if e is not None), None)
    if error is not None:
        raise error
    return outcomes


def on_every_rank(work: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """`work()` on this rank; returns its result if it succeeded on every rank, else raises on every
    rank (a failing rank its own error, the others the first failing rank's). `group` carries objects."""
    result, error = _outcome(work)
    _exchanged((None, error), group)  # only the errors travel
    return result


def gathered(work: Callable[[], T], group: dist.ProcessGroup | None = None) -> list[T]:
    """`work()` on every rank; every rank's result, by rank, on every rank, or every rank raises as in
    `on_every_rank` (small results: they travel pickled, e.g. a rank's share of an evaluation's samples)."""
    return [result for result, _ in _exchanged(_outcome(work), group)]


def on_rank0(work: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """`work()` on rank 0 only; its result, or its error, on every rank."""
    outcome: tuple[Any, BaseException | None] = (None, None)
    if dist.get_rank() == 0:
        try:
            outcome = (work(), None)
        except Exception as raised:
            if dist.get_world_size() == 1:
                raise
            outcome = (None, raised)
    if dist.get_world_size() > 1:
        box = [(outcome[0], _portable(outcome[1]))]
        dist.broadcast_object_list(box, src=0, group=group)
        if dist.get_rank() == 0 and outcome[1] is not None:
            raise outcome[1]
        outcome = box[0]
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def gather_rows(group: dist.ProcessGroup | None = None) -> Callable[[Tensor], Tensor]:
    """A gather of one small CPU row per rank into a (world size, n) tensor, e.g. every rank's loss and
    gradient norm for `dmd2.optim.optimizer_step` (on the group that carries objects: gloo, CPU)."""
    def gather(row: Tensor) -> Tensor:
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, row, group=group)
        return torch.stack(rows)
    return gather

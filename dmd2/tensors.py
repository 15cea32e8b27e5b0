"""Flat tensor dicts for the records the stages hand each other (what safetensors can store).

A record is a frozen dataclass whose fields are tensors or dicts of tensors (conditionings); a dict
field `cond` with key `class_labels` is stored as `cond.class_labels`. An optional tensor field (default
None) that is None is not stored, and comes back None.
"""

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Iterable, TypeVar

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily  # is_fake: also the families'

Record = TypeVar("Record")


def to_tensor_dict(record: object) -> dict[str, Tensor]:
    """Flatten a record into {name: tensor}, contiguous as safetensors requires."""
    flat: dict[str, Tensor] = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if value is None:
            continue
        if isinstance(value, dict):
            flat.update({f"{field.name}.{key}": tensor.contiguous() for key, tensor in value.items()})
        else:
            flat[field.name] = value.contiguous()
    return flat


def from_tensor_dict(record_type: type[Record], flat: dict[str, Tensor]) -> Record:
    """Rebuild a record from `to_tensor_dict`'s output; a missing or unexpected key is an error."""
    values: dict[str, object] = {}
    for field in dataclasses.fields(record_type):
        if field.name in flat:
            values[field.name] = flat[field.name]
        elif field.default is None:
            continue  # an optional field that was None
        else:
            prefix = field.name + "."
            values[field.name] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    known = {f.name for f in dataclasses.fields(record_type)}
    unexpected = [key for key in flat if key.split(".")[0] not in known]
    if unexpected:
        raise ValueError(f"{record_type.__name__} has no fields {unexpected}")
    return record_type(**values)


@contextmanager
def on_host() -> Iterator[None]:
    """Host bookkeeping (sample indices, random draws, stop steps) runs on real tensors, even while `dmd2 plan`
    runs the device work on fake ones (torch's `FakeTensorMode`): it is small, and its values decide shapes."""
    with unset_fake_temporarily():
        yield


def figure(tensor: Tensor) -> float:
    """A one-element tensor's value, for metrics and checks; 0.0 for a fake tensor (a plan has no values)."""
    return 0.0 if is_fake(tensor) else tensor.item()


HOST_FIELDS = frozenset({"sample_index"})  # bookkeeping keys the host reads (draws, matching scores to pairs)


def select_rows(record: Record, rows: Tensor | slice) -> Record:
    """The same record restricted to some rows (every field is batched along dim 0)."""
    picked = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if value is None:
            picked[field.name] = None
        elif field.name in HOST_FIELDS:
            with on_host():
                picked[field.name] = value[rows]
        else:
            picked[field.name] = {k: v[rows] for k, v in value.items()} if isinstance(value, dict) else value[rows]
    return type(record)(**picked)


def to_device(record: Record, device: torch.device | str) -> Record:
    """The record with its tensors on `device`, once per stage, so no model call moves data.

    `sample_index` stays on the host: it only keys draws and matches scores to pairs, and reading it
    from a GPU would synchronize the device.
    """
    moved = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if value is None:
            moved[field.name] = None
        elif field.name in HOST_FIELDS:
            moved[field.name] = value.cpu()
        elif isinstance(value, dict):
            moved[field.name] = {k: v.to(device) for k, v in value.items()}
        else:
            moved[field.name] = value.to(device)
    return type(record)(**moved)


def non_finite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The first floating-point tensor holding a NaN or an infinity, described ("name: 3 of 4096 values
    not finite"), or None when all are finite (and for fake tensors, which hold no values). Checked before
    anything is stored."""
    for name, tensor in named:
        if tensor.is_floating_point() and not is_fake(tensor):
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                first = tensor[~finite].reshape(-1)[0].item()
                return f"{name}: {int((~finite).sum())} of {tensor.numel()} values not finite (the first: {first})"
    return None

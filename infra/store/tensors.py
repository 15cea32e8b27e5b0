"""Tensor dicts in the store, in the safetensors format, written and read so that the hash runs
on other threads over the very buffers being moved, and no tensor is handed out unverified.

Writing (``serialize``): the store lays out the file itself: an 8-byte little-endian header
length, the JSON header padded with spaces to a multiple of 8, then each tensor's bytes. The file
is thus a small header followed by the tensors' own memory, so the hash can start on the first
byte while the same buffers are written, with no serialised copy in between
(``safetensors.torch.save_file`` writes an equivalent file, but has nothing to hash until it has
finished). Tensors are ordered by element size, largest first, so that each starts at a multiple
of its element size, as with safetensors' own writer.

Reading (``read_verified``): the file is read into one private buffer, the pieces of the store's
digest in parallel, each hashed by the thread that read it; only once the digest matches is the
header parsed (JSON) and checked as safetensors' loader checks it, and the tensors are views of
that buffer. So they hold exactly the bytes that were hashed, nothing unverified is ever parsed,
and later changes to the stored object cannot reach them (they live in private memory, as with
``safetensors.torch.load``, not in a mapping of the file, as with ``load_file``).
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
from collections.abc import Callable, Mapping

import numpy as np
import torch

from infra.store.digest import PIECE_BYTES, Buffer, fill_hashing
from infra.store.faults import check_sha256

# safetensors' names of the dtypes the store writes; its loader knows every one of them.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_METADATA_KEY = "__metadata__"  # reserved by the format for free-text metadata
_LENGTH_BYTES = 8  # the header length that starts the file


def serialize(tensors: Mapping[str, torch.Tensor]) -> list[Buffer]:
    """The safetensors file of ``tensors`` as buffers whose concatenation is the file.

    The first buffer is the header; the others are the tensors' own memory (CPU tensors are not
    copied), so the tensors must not change until the buffers are written and hashed. Refuses,
    as ``safetensors.torch.save_file`` does, non-tensors, sparse and non-contiguous tensors,
    and tensors that overlap in memory; also dtypes outside ``DTYPE_NAMES``.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors is little-endian: the store writes it on such hosts")
    for name, tensor in tensors.items():
        _check_tensor(name, tensor)
    _refuse_shared_memory(tensors)
    # Largest elements first: each tensor's length is a multiple of its element size, so every
    # tensor then starts at a multiple of its own element size (the header is padded to 8).
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header, data, offset = {}, [], 0
    for name in names:
        tensor = tensors[name]
        data.append(_bytes_of(tensor))
        end = offset + len(data[-1])
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    return [_encode_header(header), *data]


def read_verified(
    size: int,
    read_at: Callable[[memoryview, int], int],
    uri: str,
    sha256: str,
    nbytes: int,
    device: str,
    span: int = PIECE_BYTES,
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors object of ``size`` bytes, once its digest matched ``sha256``.

    ``read_at(view, offset)`` reads the object's bytes from ``offset`` into ``view`` (``span``
    bytes at most) and returns the count; spans are read in parallel (``store_digest.fill_hashing``).
    Raises ``IntegrityError`` if the bytes do not match (``nbytes`` only words the message), and
    ``ValueError`` if verified bytes are not a safetensors file.
    """
    data = np.empty(size, dtype=np.uint8)  # not zero-filled: the read writes every byte
    digest, filled = fill_hashing(memoryview(data), read_at, span)
    detail = "" if filled == nbytes else f"expected {nbytes} bytes, found {filled}"
    check_sha256(uri, sha256, digest, detail)
    tensors = _tensors_in(data[:filled], uri)
    return tensors if device == "cpu" else {name: t.to(device) for name, t in tensors.items()}


def _check_tensor(name: object, tensor: object) -> None:
    if not isinstance(name, str) or name == _METADATA_KEY:
        raise ValueError(f"tensor names must be strings other than {_METADATA_KEY!r}: {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{name!r} is a sparse tensor; store tensor.to_dense()")
    if not tensor.is_contiguous():
        raise ValueError(f"{name!r} is not contiguous; store tensor.contiguous()")
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"{name!r} has dtype {tensor.dtype}, which the store does not write")


def _refuse_shared_memory(tensors: Mapping[str, torch.Tensor]) -> None:
    """safetensors' rule: tensors must not overlap in memory (the file would hold the bytes twice,
    and once loaded they would no longer be tied)."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in tensors.items()
        if t.numel() > 0
    )
    widest = None  # the span reaching furthest so far on the current device
    for span in spans:
        device, start, end, name = span
        if widest is not None and widest[0] == device and start < widest[2]:
            raise ValueError(f"tensors {widest[3]!r} and {name!r} share memory; store a .clone()")
        if widest is None or widest[0] != device or end > widest[2]:
            widest = span


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor: a view of its memory if it is on the CPU.

    The view goes through ctypes, not `.numpy()`: numpy would pin the caller's storage at its size
    for good, and in-place offloading (a trainer group's sleep) resizes the storages of the very
    parameters a checkpoint or an export stores. A put must leave its inputs as they were.
    """
    plain = tensor.detach().cpu().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)
    if plain.numel() == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * plain.numel()).from_address(plain.data_ptr())
    raw.keepalive = plain  # the memoryview holds `raw`, `raw` holds the (possibly temporary) CPU tensor
    return memoryview(raw).cast("B")


def _encode_header(header: dict) -> bytes:
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format's padding, so that the data is 8-aligned
    return struct.pack("<Q", len(encoded)) + encoded


def _tensors_in(data: np.ndarray, uri: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file in ``data``, each a view of its own bytes there.

    Checks what safetensors' loader checks: known dtypes, shapes that match their byte ranges,
    ranges that tile the data exactly; and that each tensor is aligned to its element size.
    """
    if len(data) < _LENGTH_BYTES:
        raise ValueError(f"{uri} is too short for a safetensors file")
    start = _LENGTH_BYTES + int.from_bytes(data[:_LENGTH_BYTES].tobytes(), "little")
    if start > len(data):
        raise ValueError(f"{uri}: the safetensors header runs past the end of the file")
    try:
        header = json.loads(data[_LENGTH_BYTES:start].tobytes())
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"{uri}: the safetensors header is not JSON") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{uri}: the safetensors header is not a JSON object")
    header.pop(_METADATA_KEY, None)
    layouts = sorted((_layout(name, entry, uri) for name, entry in header.items()))
    tensors, end = {}, 0
    for begin, stop, name, dtype, shape in layouts:
        if begin != end:
            raise ValueError(f"{uri}: tensor {name!r} does not start where the previous ends")
        if (start + begin) % dtype.itemsize:
            raise ValueError(f"{uri}: tensor {name!r} is not aligned to its element size")
        tensors[name] = _view(data[start + begin : start + stop], dtype, shape)
        end = stop
    if start + end != len(data):
        raise ValueError(f"{uri}: the tensors do not fill the file")
    return tensors


def _layout(name: str, entry: object, uri: str) -> tuple[int, int, str, torch.dtype, list[int]]:
    """(begin, end, name, dtype, shape) of one header entry, checked."""
    try:
        dtype = _DTYPES[entry["dtype"]]  # type: ignore[index]
        shape, offsets = list(entry["shape"]), list(entry["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{uri}: bad safetensors header entry for {name!r}") from exc
    integers = [*shape, *offsets]
    if len(offsets) != 2 or any(type(n) is not int or n < 0 for n in integers):
        raise ValueError(f"{uri}: bad shape or data offsets for {name!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{uri}: the data offsets of {name!r} do not match its shape and dtype")
    return begin, end, name, dtype, shape


def _view(data: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over ``data`` (no copy), with a storage of its own bytes only, as load_file's."""
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    return torch.frombuffer(data, dtype=dtype).view(shape)

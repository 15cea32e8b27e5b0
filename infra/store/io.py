"""Local-file helpers shared by the store's parts: copies hashed while the bytes move (in
parallel spans where the source allows positional reads), staging names, and the walk of a folder
to be stored. The digest itself is ``infra.store.digest``'s."""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from infra.store.digest import (
    PIECE_BYTES,
    Buffer,
    PiecewiseSha256,
    ReadAt,
    hash_spans,
    hash_threads,
    read_fully,
)
from infra.store.keys import MANIFEST_NAME, validate_key

CHUNK_BYTES = 8 * PIECE_BYTES


class Writable(Protocol):
    """Anything with a binary ``write`` (a local file, an s3fs upload)."""

    def write(self, data: bytes) -> object: ...


def digest_while(data: Buffer, write: Callable[[], None]) -> str:
    """Return the store's digest of ``data``, computed on the hashing pool while ``write()`` runs.

    Exceptions of ``write`` propagate.
    """
    with PiecewiseSha256() as hasher:
        hasher.update(data)
        write()
        return hasher.hexdigest()


def write_hashing(buffers: list[Buffer], dst: Writable) -> str:
    """Write ``buffers`` to ``dst``; return the digest of their concatenation, hashed meanwhile."""
    with PiecewiseSha256() as hasher:
        for buffer in buffers:
            hasher.update(buffer)
        for buffer in buffers:
            dst.write(buffer)
        return hasher.hexdigest()


def pread_from(file: BinaryIO) -> ReadAt:
    """A ``read_at``: positional reads of an open local file (thread-safe)."""
    fd = file.fileno()
    return lambda region, offset: os.preadv(fd, [region], offset)


def copy_to_file_hashing(
    out: BinaryIO, size: int, read_at: ReadAt, span: int = PIECE_BYTES
) -> tuple[str, int]:
    """Write an object of ``size`` bytes, read through ``read_at(view, offset)``, into the empty
    file ``out``: spans in parallel, each read into its thread's scratch buffer, hashed and
    written at its offset by that thread (``hash_spans``). Returns (digest, bytes copied); an
    object that turns out shorter leaves the file short too, and the caller's digest check fails.
    """
    fd = out.fileno()

    def read_span(start: int, length: int) -> memoryview:
        scratch = _scratch(span)[:length]
        data = scratch[: read_fully(read_at, scratch, start)]
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], start + written)
        return data

    return hash_spans(size, read_span, span)


_thread_scratch = threading.local()


def _scratch(size: int) -> memoryview:
    """This thread's reusable buffer of at least ``size`` bytes (each pool thread has its own)."""
    buffer = getattr(_thread_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _thread_scratch.buffer = memoryview(bytearray(size))
    return buffer


def copy_hashing(src: BinaryIO, dst: Writable) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in chunks; return (digest, byte count) of what was copied.

    The pieces of each chunk are hashed on the pool while the next chunk is read and written;
    at most two chunks wait to be hashed, which bounds the memory of a fast copy.
    """
    nbytes = 0
    backlog = max(2 * CHUNK_BYTES // PIECE_BYTES, 2 * hash_threads())
    with PiecewiseSha256(max_backlog=backlog) as hasher:
        while chunk := src.read(CHUNK_BYTES):
            hasher.update(chunk)
            dst.write(chunk)
            nbytes += len(chunk)
        return hasher.hexdigest(), nbytes


def hidden_sibling(path: str, tag: str) -> str:
    """A unique hidden name next to ``path`` for staging a write.

    Store keys never start with '.', so it cannot collide with an artifact, and listings skip it.
    """
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{tag}-{uuid.uuid4().hex[:12]}")


_STAGING_NAME = re.compile(r"\..+\.(tmp|partial)-[0-9a-f]{12}")


def is_staging_name(name: str) -> bool:
    """True for a name ``hidden_sibling`` makes (a write in progress, or one whose writer died)."""
    return _STAGING_NAME.fullmatch(name) is not None


def newest_mtime(path: str) -> float:
    """The latest modification time of ``path`` and, for a folder, of everything below it."""
    newest = os.lstat(path).st_mtime
    for folder, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest


def list_local_files(root: Path) -> list[tuple[str, Path]]:
    """(relative key, path) of every file below ``root``, sorted by key.

    Refuses what could not be stored faithfully: unsafe names (``validate_key``), a top-level
    MANIFEST.json (the store's own), symlinked folders (os.walk would skip them silently) and
    special files (reading a FIFO would block forever).
    """
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder")
    files = []
    for folder, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if os.path.islink(os.path.join(folder, name)):
                raise ValueError(f"{os.path.join(folder, name)} is a symlinked folder; copy it")
        for name in filenames:
            path = Path(folder, name)
            if not path.is_file():
                raise ValueError(f"{path} is not a regular file")
            files.append((validate_key(path.relative_to(root).as_posix()), path))
    if any(rel_path == MANIFEST_NAME for rel_path, _ in files):
        raise ValueError(f"{root / MANIFEST_NAME} clashes with the store's manifest name")
    return sorted(files)

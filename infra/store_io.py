"""Local-file helpers shared by the store's parts: hashing on a second thread while the bytes move,
staging names, and the walk of a folder to be stored."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

from infra.store_keys import MANIFEST_NAME, validate_key

CHUNK_BYTES = 8 * 2**20
# Chunks a copy may read ahead of its hash: enough to keep both threads busy, and a bound on the
# memory a fast reader can pile up while the hash catches up.
_COPY_BACKLOG = 2

Buffer = bytes | bytearray | memoryview


class Writable(Protocol):
    """Anything with a binary ``write`` (a local file, an s3fs upload)."""

    def write(self, data: bytes) -> object: ...


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class BackgroundSha256:
    """A sha256 computed on a worker thread while the caller moves the same bytes.

    sha256 (about 1 GB/s on one core) is the slowest step of a verified put or get. hashlib
    releases the GIL on large buffers, and so do file reads, writes and fsync, so with a second
    core the hash runs beside the I/O instead of after it.

    ``update`` queues a buffer and returns at once; buffers are hashed in the order queued (one
    worker). The caller must not change a queued buffer before ``hexdigest`` returns. With
    ``max_backlog``, ``update`` first waits while that many buffers are still unhashed, which
    bounds the memory of a copy that reads faster than it hashes. Use it as a context manager:
    leaving the block stops the worker, also when the caller failed midway.
    """

    def __init__(self, max_backlog: int | None = None):
        self._hasher = hashlib.sha256()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-sha256")
        self._backlog: deque[Future[None]] = deque()
        self._max_backlog = max_backlog

    def __enter__(self) -> BackgroundSha256:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # The buffer being hashed is finished (hashlib cannot be interrupted); queued ones are not.
        self._worker.shutdown(wait=True, cancel_futures=True)

    def update(self, data: Buffer) -> None:
        """Queue ``data`` to be hashed after the buffers queued before it."""
        if self._max_backlog is not None and len(self._backlog) >= self._max_backlog:
            self._backlog.popleft().result()
        self._backlog.append(self._worker.submit(self._hasher.update, data))

    def hexdigest(self) -> str:
        """Hex sha256 of every buffer queued so far, once all are hashed."""
        while self._backlog:
            self._backlog.popleft().result()
        return self._hasher.hexdigest()


def sha256_hex(data: Buffer) -> str:
    """Hex sha256 of a buffer."""
    return hashlib.sha256(data).hexdigest()


def sha256_while(data: Buffer, write: Callable[[], None]) -> str:
    """Return the sha256 of ``data``, computed on a second thread while ``write()`` runs.

    Exceptions of ``write`` propagate.
    """
    with BackgroundSha256() as hasher:
        hasher.update(data)
        write()
        return hasher.hexdigest()


def copy_hashing(src: BinaryIO, dst: Writable) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in chunks; return (sha256 hex, byte count) of what was copied.

    Each chunk is hashed on a second thread while the next one is read and written.
    """
    nbytes = 0
    with BackgroundSha256(max_backlog=_COPY_BACKLOG) as hasher:
        while chunk := src.read(CHUNK_BYTES):
            hasher.update(chunk)
            dst.write(chunk)
            nbytes += len(chunk)
        return hasher.hexdigest(), nbytes


def hash_file(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex, size) of a local file, read in chunks."""
    with open(path, "rb") as src:
        return copy_hashing(src, _Discard())


def hidden_sibling(path: str, tag: str) -> str:
    """A unique hidden name next to ``path`` for staging a write.

    Store keys never start with '.', so it cannot collide with an artifact, and listings skip it.
    """
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{tag}-{uuid.uuid4().hex[:12]}")


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

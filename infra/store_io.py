"""Local-file helpers shared by the store's parts: hashing in the same pass that moves the bytes,
staging names, and the walk of a folder to be stored."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

from infra.store_keys import MANIFEST_NAME, validate_key

CHUNK_BYTES = 8 * 2**20


class Writable(Protocol):
    """Anything with a binary ``write`` (a local file, an s3fs upload)."""

    def write(self, data: bytes) -> object: ...


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of a buffer."""
    return hashlib.sha256(data).hexdigest()


def sha256_while(data: bytes, write: Callable[[], None]) -> str:
    """Return the sha256 of ``data``, computed on a second thread while ``write()`` runs.

    hashlib releases the GIL on large buffers and so do file and socket writes, so the hash costs
    no wall time when a second core is free. Exceptions of ``write`` propagate.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-sha256") as pool:
        digest = pool.submit(sha256_hex, data)
        write()
        return digest.result()


def copy_hashing(src: BinaryIO, dst: Writable) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in chunks; return (sha256 hex, byte count) of what was copied."""
    hasher = hashlib.sha256()
    nbytes = 0
    while chunk := src.read(CHUNK_BYTES):
        hasher.update(chunk)
        dst.write(chunk)
        nbytes += len(chunk)
    return hasher.hexdigest(), nbytes


def hash_file(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex, size) of a local file, read in chunks."""
    hasher = hashlib.sha256()
    nbytes = 0
    with open(path, "rb") as src:
        while chunk := src.read(CHUNK_BYTES):
            hasher.update(chunk)
            nbytes += len(chunk)
    return hasher.hexdigest(), nbytes


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

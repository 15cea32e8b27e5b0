"""What a local folder and S3 do alike, through one fsspec code path (read, copy out hashing, list, delete,
move); how writes become visible, and conditional writes, are ``local.py``'s and ``s3.py``'s. Also the digests,
the staging names of writes in progress and the walk of a folder to be stored.

Every object is checked against the plain sha256 of its bytes, what ``sha256sum`` prints. Stores written before
manifest format v2 hold a piece-wise digest instead (sha256 of the concatenated sha256s of the object's 1 MiB
pieces); it is computed only when the plain one does not match, so they still verify.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from fsspec import AbstractFileSystem

from infra.store.faults import IntegrityError, client_error_code, describe
from infra.store.keys import MANIFEST_NAME, validate_key

T = TypeVar("T")
logger = logging.getLogger(__name__)
# Large enough that requests are few on S3, small enough that a copy holds little memory.
BLOCK_BYTES = 8 * 2**20
LEGACY_PIECE_BYTES = 2**20
_STAGING_NAME = re.compile(r"\..+\.(tmp|partial)-[0-9a-f]{12}")


class Backend:
    """Objects below ``root_path`` of the fsspec filesystem ``fs``; keys are validated by the store."""

    def __init__(self, fs: AbstractFileSystem, root_path: str, root_uri: str):
        self.fs, self.root_path, self.root_uri = fs, root_path, root_uri

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root_uri!r})"

    def path(self, key: str) -> str:
        return f"{self.root_path}/{key}"

    def uri_of(self, key: str) -> str:
        return f"{self.root_uri}/{key}"

    def read_bytes(self, key: str) -> bytes:
        return self.fs.cat_file(self.path(key))

    def read_to(self, key: str, dest: str) -> tuple[str, int]:
        """Copy the object at ``key`` into the new local file ``dest``; (sha256, size) of what was copied."""
        with self.fs.open(self.path(key), "rb", block_size=BLOCK_BYTES) as src, open(dest, "xb") as out:
            return write_hashing(iter(lambda: src.read(BLOCK_BYTES), b""), out)

    def list_dirs(self, key: str) -> list[str]:
        """Names of the visible sub-folders of ``key`` (none if it does not exist)."""
        entries = absent_is_none(lambda: self.fs.ls(self.path(key), detail=True)) or []
        names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")
        return sorted(name for name in names if not name.startswith("."))

    def delete_tree(self, key: str) -> None:
        """Remove ``key`` (an object, or a folder and everything below it); nothing there is not an error."""
        absent_is_none(lambda: self.fs.rm(self.path(key), recursive=True))

    def delete_dir(self, key: str) -> None:
        """``delete_tree``, a directory's manifest first: readers stop seeing it at once."""
        self.delete_tree(f"{key}/{MANIFEST_NAME}")
        self.delete_tree(key)

    def discard_staging(self, staging: str) -> None:
        """Delete what a failed directory write left; best effort (a leftover stays invisible without a manifest)."""
        try:
            absent_is_none(lambda: self.fs.rm(staging, recursive=True))
        except Exception as exc:
            logger.warning("could not remove %s, left by a failed write: %s", staging, describe(exc))

    def move_tree(self, key: str, new_key: str) -> None:
        """Move ``key`` and everything below it to ``new_key``: copies, then ``delete_dir`` of the originals."""
        src, dst = self.path(key), self.path(new_key)
        for path in self.fs.find(src):
            self.fs.copy(path, dst + path[len(src):])
        self.delete_dir(key)


def absent_is_none(call: Callable[[], T]) -> T | None:
    """``call()``, or None if what it looked for is absent; a missing bucket is not absence, and raises."""
    try:
        return call()
    except FileNotFoundError as exc:
        if (client_error_code(exc) or ("",))[0] == "NoSuchBucket":
            raise
        return None


def write_hashing(chunks: Iterable[bytes], out) -> tuple[str, int]:
    """Write ``chunks`` to ``out``; (sha256, size) of what was written, hashed on the way."""
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        digest.update(chunk)
        out.write(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def file_chunks(path: str | os.PathLike, size: int = BLOCK_BYTES) -> Iterable[bytes]:
    with open(path, "rb") as file:
        yield from iter(lambda: file.read(size), b"")


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def legacy_sha256(data: bytes | bytearray | memoryview) -> str:
    view = memoryview(data).cast("B")
    return _legacy_of(view[at : at + LEGACY_PIECE_BYTES] for at in range(0, len(view), LEGACY_PIECE_BYTES))


def file_sha256(path: str | os.PathLike, legacy: bool = False) -> str:
    """The plain (or ``legacy``) digest of a local file, read in pieces."""
    if legacy:
        return _legacy_of(file_chunks(path, LEGACY_PIECE_BYTES))
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _legacy_of(pieces: Iterable[bytes | memoryview]) -> str:
    return hashlib.sha256(b"".join(hashlib.sha256(piece).digest() for piece in pieces)).hexdigest()


def verify(uri: str, expected: str, actual: str, legacy: Callable[[], str], detail: str = "") -> None:
    """``IntegrityError`` unless ``actual`` (the plain sha256) or, for an older store's object, ``legacy()`` is
    the ``expected`` digest."""
    if actual != expected and legacy() != expected:
        raise IntegrityError(uri, expected, actual, detail)


def hidden_sibling(path: str, tag: str) -> str:
    """A unique hidden name next to ``path`` for staging a write (keys never start with '.', so it cannot
    collide with an artifact, and listings skip it)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{tag}-{uuid.uuid4().hex[:12]}")


def is_staging_name(name: str) -> bool:
    """True for a name ``hidden_sibling`` makes (a write in progress, or one whose writer died)."""
    return _STAGING_NAME.fullmatch(name) is not None


def list_local_files(root: Path) -> list[tuple[str, Path]]:
    """(key, path) of every file below ``root``, sorted. Refuses what could not be stored faithfully: unsafe
    names, a top-level MANIFEST.json (the store's own), symlinked folders (os.walk would skip them silently)
    and special files (reading a FIFO would block forever)."""
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

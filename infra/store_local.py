"""The ``file://`` backend of the artifact store: a folder on a local or shared filesystem.

Atomicity comes from rename: a file is written under a hidden temporary name in its final folder
and moved into place with ``os.replace``; a directory is assembled in a hidden staging folder
next to its final place (manifest last) and renamed into place in one step. Data and the
renames are fsynced, so a machine crash cannot leave a visible but torn object behind.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, TypeVar

import safetensors.torch

from infra.store_faults import ArtifactExistsError, check_sha256
from infra.store_io import copy_hashing, hidden_sibling, sha256_hex, sha256_while
from infra.store_keys import MANIFEST_NAME

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Linux exposes an open descriptor as a path; opening it reaches the very inode we hashed, even
# if the name has since been replaced, so nothing can swap the bytes between check and load.
_FD_DIR = "/proc/self/fd"


def _fsync_dir(folder: str) -> None:
    # Makes a rename durable: without it a power cut can undo the rename after we returned.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, fill: Callable[[BinaryIO], T]) -> T:
    """Create ``path`` (must not be visible to readers yet), let ``fill(file)`` write it, fsync."""
    with open(path, "xb") as file:
        result = fill(file)
        file.flush()
        os.fsync(file.fileno())
    return result


def _sha256_of_fd(fd: int, size: int) -> str:
    if size == 0:
        return sha256_hex(b"")
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        return sha256_hex(memoryview(mapped))


def _hash_and_fsync(path: str) -> tuple[str, int]:
    """(sha256, size) of a file just written, fsynced: the flush waits on the disk and the hash on
    the CPU, so they run side by side."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-fsync") as pool:
            synced = pool.submit(os.fsync, fd)
            digest = _sha256_of_fd(fd, size)
            synced.result()
        return digest, size
    finally:
        os.close(fd)


class LocalBackend:
    """Objects are files below ``root_dir``; keys are already validated by the store."""

    def __init__(self, root_dir: str):
        if not root_dir:
            raise ValueError("the file:// store needs a folder, e.g. file:///data/artifacts")
        self.root_dir = os.path.abspath(os.path.expanduser(root_dir))
        self.root_uri = "file://" + self.root_dir

    def __repr__(self) -> str:
        return f"LocalBackend({self.root_uri!r})"

    def uri_of(self, key: str) -> str:
        """The URI of a key."""
        return f"{self.root_uri}/{key}"

    def path(self, key: str) -> str:
        """Filesystem path of a key."""
        return os.path.join(self.root_dir, *key.split("/"))

    def write_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` at ``key`` atomically (temp file + fsync + os.replace); return sha256."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            digest = _write_durably(temp, lambda f: sha256_while(data, lambda: f.write(data)))
            os.replace(temp, path)
        except BaseException:
            _remove_quietly(temp)
            raise
        _fsync_dir(os.path.dirname(path))
        return digest

    def write_tensors(self, key: str, tensors: dict) -> tuple[str, int]:
        """Store ``tensors`` as safetensors at ``key`` atomically; return (sha256, size).

        ``save_file`` writes straight from the tensors' memory (no intermediate bytes object);
        the file is then hashed through a mapping of the page cache while fsync runs.
        """
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            safetensors.torch.save_file(tensors, temp)
            digest, nbytes = _hash_and_fsync(temp)
            os.replace(temp, path)
        except BaseException:
            _remove_quietly(temp)
            raise
        _fsync_dir(os.path.dirname(path))
        return digest, nbytes

    def read_bytes(self, key: str) -> bytes:
        """The bytes stored at ``key`` (``FileNotFoundError`` if absent)."""
        with open(self.path(key), "rb") as file:
            return file.read()

    def load_tensors(self, key: str, uri: str, sha256: str, nbytes: int, device: str) -> dict:
        """Verify the safetensors file at ``key`` against ``sha256`` and load it.

        The file is hashed through a read-only mapping (no copy) and then opened by its
        descriptor, so the tensors come from exactly the bytes that were checked; like
        ``safetensors.torch.load_file`` they are copy-on-write mappings of the file.
        """
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            check_sha256(uri, sha256, _sha256_of_fd(fd, size), _size_note(nbytes, size))
            if os.path.isdir(_FD_DIR):
                return safetensors.torch.load_file(f"{_FD_DIR}/{fd}", device=device)
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                tensors = safetensors.torch.load(mapped[:])
            return {name: t.to(device) for name, t in tensors.items()}
        finally:
            os.close(fd)

    def read_file_to(self, key: str, dest: str) -> tuple[str, int]:
        """Copy the object at ``key`` to the new local file ``dest``; return (sha256, size)."""
        with open(self.path(key), "rb") as src:
            return _write_durably(dest, lambda out: copy_hashing(src, out))

    def begin_dir(self, key: str) -> LocalDirWriter:
        """Start writing a directory artifact at ``key`` (see ``LocalDirWriter``)."""
        return LocalDirWriter(self.path(key))

    def exists(self, key: str) -> bool:
        """True if a file is stored at ``key``."""
        return os.path.isfile(self.path(key))

    def list_dirs(self, key: str) -> list[str]:
        """Names of the visible sub-folders of ``key`` (none if it does not exist)."""
        try:
            entries = list(os.scandir(self.path(key)))
        except FileNotFoundError:
            return []
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))

    def delete_tree(self, key: str) -> None:
        """Remove ``key`` and everything below it; a missing key is not an error."""
        try:
            shutil.rmtree(self.path(key))
        except FileNotFoundError:
            pass


class LocalDirWriter:
    """Builds a directory in a hidden staging folder; ``commit`` renames it into place.

    Until ``commit`` nothing exists at the final path, so a writer killed at any point leaves
    only a hidden ``.<name>.partial-*`` folder, which listings and ``latest_checkpoint`` ignore.
    """

    def __init__(self, final_dir: str):
        self.final_dir = final_dir
        self.staging_dir = hidden_sibling(final_dir, "partial")
        os.makedirs(self.staging_dir)

    def write_file(self, rel_path: str, local_path: str) -> tuple[str, int]:
        """Copy one local file into the staging folder; return (sha256, size) of what was read."""
        dest = os.path.join(self.staging_dir, *rel_path.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(local_path, "rb") as src:
            return _write_durably(dest, lambda out: copy_hashing(src, out))

    def commit(self, manifest: bytes) -> None:
        """Write the manifest, then make the directory visible by renaming the staging folder."""
        _write_durably(os.path.join(self.staging_dir, MANIFEST_NAME), lambda f: f.write(manifest))
        _fsync_dir(self.staging_dir)
        try:
            os.rename(self.staging_dir, self.final_dir)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise ArtifactExistsError(
                f"{self.final_dir} already exists; remove it or write to another key"
            ) from exc
        _fsync_dir(os.path.dirname(self.final_dir))

    def abort(self) -> None:
        """Delete the staging folder (best effort: a failure is logged, never raised)."""
        try:
            shutil.rmtree(self.staging_dir)
        except OSError as exc:
            logger.warning("could not remove staging folder %s: %s", self.staging_dir, exc)


def _size_note(expected: int, actual: int) -> str:
    return "" if expected == actual else f"expected {expected} bytes, found {actual}"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


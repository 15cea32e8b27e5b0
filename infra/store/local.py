"""The ``file://`` backend of the artifact store: a folder on a local or shared filesystem.

Atomicity comes from rename: a file is written under a hidden temporary name in its final folder
and moved into place with ``os.replace``; a directory is assembled in a hidden staging folder
next to its final place (manifest last) and renamed into place in one step. Data and the
renames are fsynced, so a machine crash cannot leave a visible but torn object behind; only the
writes a caller marks not durable (objects it makes again after a crash) skip the fsyncs.

Conditional writes (the run lease, ``infra.store.lease``): create-if-absent hard-links a fully
written hidden file into place (``link(2)`` refuses an existing name, so one creator wins);
compare-and-swap and conditional delete hold an exclusive ``flock`` on a hidden lock file next to
the object around read-compare-replace. That needs a filesystem whose ``flock`` excludes every
client that can reach the folder: a local disk, or NFSv4 (Linux maps ``flock`` to NFS byte-range
locks; not with the ``local_lock=flock`` or ``nolock`` mount options, under which each client
locks only against itself). An object's version is the store's digest of its bytes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO, TypeVar

from infra.store import tensors as store_tensors
from infra.store.faults import ArtifactExistsError
from infra.store.digest import Buffer, PiecewiseSha256, piecewise_sha256
from infra.store.io import (
    copy_to_file_hashing,
    hidden_sibling,
    is_staging_name,
    newest_mtime,
    pread_from,
)
from infra.store.keys import MANIFEST_NAME

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _fsync_dir(folder: str) -> None:
    # Makes a rename durable: without it a power cut can undo the rename after we returned.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: str, fill: Callable[[BinaryIO], T], durable: bool = True) -> T:
    """Create ``path`` (must not be visible to readers yet), let ``fill(file)`` write it, and fsync it
    if ``durable``."""
    with open(path, "xb") as file:
        result = fill(file)
        file.flush()
        if durable:
            os.fsync(file.fileno())
    return result


def _copy_file(src_path: str, dest: str) -> tuple[str, int]:
    """Copy ``src_path`` to the new file ``dest`` durably, in parallel spans, hashed meanwhile;
    return (digest, size) of what was copied."""
    with open(src_path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        return _write_new_file(dest, lambda out: copy_to_file_hashing(out, size, pread_from(src)))


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
        """Store ``data`` at ``key`` atomically; return its digest."""
        return self._write_atomically(key, [data])

    def write_tensors(self, key: str, tensors: dict, durable: bool = True) -> tuple[str, int]:
        """Store ``tensors`` as safetensors at ``key`` atomically; return (digest, size).

        The file is written straight from the tensors' memory (``store_tensors.serialize``),
        and the same buffers are hashed meanwhile, so no serialised copy is ever made. Not ``durable``:
        neither the file nor its rename is fsynced.
        """
        buffers = store_tensors.serialize(tensors)
        return self._write_atomically(key, buffers, durable), sum(len(buffer) for buffer in buffers)

    def _write_atomically(self, key: str, buffers: list[Buffer], durable: bool = True) -> str:
        """Store the concatenation of ``buffers`` at ``key``: written to a temp file and fsynced (if
        ``durable``), then renamed into place. Returns its digest, computed on the hashing pool meanwhile."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            with PiecewiseSha256() as hasher:
                for buffer in buffers:
                    hasher.update(buffer)
                _write_new_file(temp, lambda file: file.writelines(buffers), durable)
                digest = hasher.hexdigest()  # the write and the fsync ran while it was hashed
            os.replace(temp, path)
        except BaseException:
            _remove_quietly(temp)
            raise
        if durable:
            _fsync_dir(os.path.dirname(path))
        return digest

    def read_bytes(self, key: str) -> bytes:
        """The bytes stored at ``key`` (``FileNotFoundError`` if absent)."""
        with open(self.path(key), "rb") as file:
            return file.read()

    # -- conditional writes of small objects ---------------------------------------------------

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` at ``key`` only if nothing is there; its version, or None if something
        was. Of many concurrent creators exactly one wins, and no reader sees a partial file."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            _write_new_file(temp, lambda file: file.write(data))
            os.link(temp, path)
        except FileExistsError:
            return None
        finally:
            _remove_quietly(temp)
        _fsync_dir(os.path.dirname(path))
        return piecewise_sha256(data)

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, version) of the object at ``key``, or None if there is none."""
        data = _read_or_none(self.path(key))
        return None if data is None else (data, piecewise_sha256(data))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Replace the object at ``key`` with ``data`` if it is still at ``version``; the new
        version, or None if it changed or is gone (then nothing is written)."""
        path = self.path(key)
        if not os.path.isfile(path):  # absent (its folder too, perhaps): nothing to lock
            return None
        with _exclusive_lock(path):
            current = _read_or_none(path)
            if current is None or piecewise_sha256(current) != version:
                return None
            return self._write_atomically(key, [data])

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object at ``key`` if it is still at ``version``; True if it was deleted."""
        path = self.path(key)
        if not os.path.isfile(path):
            return False
        with _exclusive_lock(path):
            current = _read_or_none(path)
            if current is None or piecewise_sha256(current) != version:
                return False
            os.remove(path)
        _fsync_dir(os.path.dirname(path))
        return True

    def load_tensors(self, key: str, uri: str, sha256: str, nbytes: int, device: str) -> dict:
        """Read the safetensors file at ``key`` into private memory, in parallel pieces each
        hashed as it is read, and return its tensors once the digest matched
        (``store_tensors.read_verified``)."""
        with open(self.path(key), "rb") as file:
            size = os.fstat(file.fileno()).st_size
            return store_tensors.read_verified(size, pread_from(file), uri, sha256, nbytes, device)

    def read_file_to(self, key: str, dest: str) -> tuple[str, int]:
        """Copy the object at ``key`` to the new local file ``dest``; return (digest, size)."""
        return _copy_file(self.path(key), dest)

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
        """Remove ``key`` (a file, or a folder and everything below it); a missing key is not an error."""
        path = self.path(key)
        try:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except FileNotFoundError:
            pass

    def delete_stale_staging(self, key: str, max_age_s: float) -> list[str]:
        """Delete what killed writers left below ``key``: staging files and folders (hidden, see
        ``hidden_sibling``) in which nothing changed for ``max_age_s`` seconds; return their
        paths. A live writer keeps changing its staging, so it is never caught.
        """
        cutoff, removed = time.time() - max_age_s, []
        for folder, dirnames, filenames in os.walk(self.path(key)):
            staging = [name for name in [*dirnames, *filenames] if is_staging_name(name)]
            dirnames[:] = [name for name in dirnames if not is_staging_name(name)]
            for name in staging:
                path = os.path.join(folder, name)
                try:
                    if newest_mtime(path) >= cutoff:
                        continue
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                except FileNotFoundError:
                    continue  # its writer finished or cleaned up meanwhile
                removed.append(path)
        return removed


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
        """Copy one local file into the staging folder; return (digest, size) of what was read."""
        dest = os.path.join(self.staging_dir, *rel_path.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        return _copy_file(local_path, dest)

    def commit(self, manifest: bytes) -> None:
        """Write the manifest, then make the directory visible by renaming the staging folder."""
        _write_new_file(os.path.join(self.staging_dir, MANIFEST_NAME), lambda f: f.write(manifest))
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


@contextmanager
def _exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` next to ``path`` (created if need be).

    The lock file is never deleted: removing it could let two processes lock two different
    files of one name. The kernel drops the lock of a killed process, so none is ever stale.
    """
    folder, name = os.path.split(path)
    fd = os.open(os.path.join(folder, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def _read_or_none(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


"""The ``file://`` backend: a folder on a local or shared filesystem (fsspec's ``LocalFileSystem``).

Visible only when complete: an object is written to a hidden temporary file in its final folder, created
with ``open(path, "xb")`` so that it gets the user's umask like any other file (``tempfile.mkstemp`` would
make it 0600), fsynced, and renamed into place; the rename is fsynced too, so a machine crash cannot leave a
torn object visible. Only writes a caller marks not durable (objects made again after a crash) skip the
fsyncs. A directory is assembled in a hidden staging folder next to its place, manifest last, and renamed
into place in one step.

Conditional writes (the run lease): create-if-absent hard-links a fully written hidden file into place
(``link(2)`` refuses an existing name, so one creator wins); compare-and-swap and conditional delete hold
an exclusive ``flock`` on a hidden lock file next to the object around read-compare-replace. That needs a
filesystem whose ``flock`` excludes every client: a local disk, or NFSv4 (not with the ``local_lock=flock``
or ``nolock`` mount options). An object's version is the sha256 of its bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from fsspec.implementations.local import LocalFileSystem

from infra.store.digest import sha256_hex
from infra.store.faults import ArtifactExistsError, StoreError, refused_write
from infra.store.io import Backend, hidden_sibling, is_staging_name, write_hashing


class LocalBackend(Backend):
    """Objects are files below a folder."""

    def __init__(self, folder: str):
        if not folder:
            raise ValueError("the file:// store needs a folder, e.g. file:///data/artifacts")
        root = os.path.abspath(os.path.expanduser(folder))
        super().__init__(LocalFileSystem(), root, "file://" + root)

    def translate(self, exc: BaseException, uri: str, writing: bool) -> StoreError | None:
        """A refused write as a ``StoreWriteError``; anything else propagates as it is."""
        return refused_write(exc, uri) if writing else None

    def write(self, path: str, chunks: Iterable[bytes], durable: bool = True) -> tuple[str, int]:
        """Store the concatenation of ``chunks`` at ``path`` atomically; (sha256, size), hashed meanwhile."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            with open(temp, "xb") as file:
                result = write_hashing(chunks, file)
                file.flush()
                if durable:
                    os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            _remove_quietly(temp)
            raise
        if durable:
            _fsync_dir(folder)
        return result

    def staging_dir(self, key: str) -> str:
        """Where a directory at ``key`` is assembled: a hidden sibling that listings and readers ignore."""
        staging = hidden_sibling(self.path(key), "partial")
        os.makedirs(staging)
        return staging

    def publish_dir(self, key: str, staging: str) -> None:
        """Make the assembled directory visible at ``key`` in one rename."""
        final = self.path(key)
        _fsync_dir(staging)
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise ArtifactExistsError(f"{final} already exists; remove it or write to another key") from exc
        _fsync_dir(os.path.dirname(final))

    def move_tree(self, key: str, new_key: str) -> None:
        """Move ``key`` (a folder or a file) to ``new_key`` in one rename: it is never half there."""
        os.makedirs(os.path.dirname(self.path(new_key)), exist_ok=True)
        os.rename(self.path(key), self.path(new_key))
        for path in (self.path(new_key), self.path(key)):  # both folders' entries changed
            _fsync_dir(os.path.dirname(path))

    def delete_stale_staging(self, key: str, max_age_s: float) -> list[str]:
        """Delete what killed writers left below ``key`` (hidden staging in which nothing changed for
        ``max_age_s`` seconds; a live writer keeps changing its own); return the paths deleted."""
        cutoff, removed = time.time() - max_age_s, []
        for folder, dirnames, filenames in os.walk(self.path(key)):
            staging = [name for name in [*dirnames, *filenames] if is_staging_name(name)]
            dirnames[:] = [name for name in dirnames if not is_staging_name(name)]
            for path in (os.path.join(folder, name) for name in staging):
                try:
                    if _newest_mtime(path) < cutoff:
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                        removed.append(path)
                except FileNotFoundError:
                    continue  # its writer finished or cleaned up meanwhile
        return removed

    # -- conditional writes of small objects ---------------------------------------------------

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` at ``key`` only if nothing is there; its version, or None if something was."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            with open(temp, "xb") as file:
                file.write(data)
                os.fsync(file.fileno())
            os.link(temp, path)
        except FileExistsError:
            return None
        finally:
            _remove_quietly(temp)
        _fsync_dir(os.path.dirname(path))
        return sha256_hex(data)

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, version) of the object at ``key``, or None if there is none."""
        data = _read_or_none(self.path(key))
        return None if data is None else (data, sha256_hex(data))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Replace the object at ``key`` with ``data`` if it is still at ``version``; the new version, or
        None if it changed or is gone (then nothing is written)."""
        path = self.path(key)
        if not os.path.isfile(path):  # absent (its folder too, perhaps): nothing to lock
            return None
        with _exclusive_lock(path):
            current = _read_or_none(path)
            if current is None or sha256_hex(current) != version:
                return None
            return self.write(path, [data])[0]

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object at ``key`` if it is still at ``version``; True if it was deleted."""
        path = self.path(key)
        if not os.path.isfile(path):
            return False
        with _exclusive_lock(path):
            current = _read_or_none(path)
            if current is None or sha256_hex(current) != version:
                return False
            os.remove(path)
        _fsync_dir(os.path.dirname(path))
        return True


@contextmanager
def _exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` next to ``path``. The lock file is never deleted:
    removing it could let two processes lock two different files of one name; the kernel drops the lock
    of a killed process, so none is ever stale."""
    folder, name = os.path.split(path)
    fd = os.open(os.path.join(folder, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def _fsync_dir(folder: str) -> None:
    # Makes a rename durable: without it a power cut can undo the rename after we returned.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _newest_mtime(path: str) -> float:
    """The latest modification time of ``path`` and, for a folder, of everything below it."""
    newest = os.lstat(path).st_mtime
    for folder, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest


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

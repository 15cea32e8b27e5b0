"""The ``file://`` backend: a folder on a local or shared filesystem (fsspec's ``LocalFileSystem``).

Visible only when complete: an object is written to a hidden file beside it (``open(path, "xb")``, so it gets the
user's umask where ``mkstemp`` would give 0600), fsynced and renamed into place, the rename fsynced too (unless the
caller marks the write not durable); a directory is assembled in a hidden folder and renamed into place at once.
Conditional writes (the lease): create-if-absent hard-links a complete hidden file into place (``link(2)`` refuses
an existing name, so one creator wins); replace-if and delete-if hold an exclusive ``flock`` on a lock file beside
the object, which needs a filesystem whose ``flock`` excludes every client (a local disk, or NFSv4 without the
``local_lock=flock`` or ``nolock`` mount options). An object's version is the sha256 of its bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from infra.store.faults import ArtifactExistsError, StoreError, refused_write
from infra.store.io import Backend, absent_is_none, hidden_sibling, is_staging_name, sha256_hex, write_hashing


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

    def write(self, path: str, chunks: Iterable[bytes], durable: bool = True,
              place: Callable[[str, str], None] = os.replace) -> tuple[str, int]:
        """Store the concatenation of ``chunks`` at ``path``, all or nothing: a hidden file put in its ``place``
        (``os.replace``; ``os.link`` refuses an existing file); (sha256, size), hashed meanwhile."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = hidden_sibling(path, "tmp")
        try:
            with open(temp, "xb") as file:
                result = write_hashing(chunks, file)
                file.flush()
                if durable:
                    os.fsync(file.fileno())
            place(temp, path)
        finally:
            with suppress(FileNotFoundError):
                os.remove(temp)  # gone once replaced; left by a link or a failure
        if durable:
            _fsync_dir(os.path.dirname(path))
        return result

    def staging_dir(self, key: str) -> str:
        """A hidden sibling of ``key``, which listings and readers ignore, to assemble a directory in."""
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
        """Delete the staging below ``key`` in which nothing changed for ``max_age_s`` (a live writer keeps
        changing its own); the paths deleted."""
        cutoff, removed = time.time() - max_age_s, []
        for folder, dirnames, filenames in os.walk(self.path(key)):
            staging = [os.path.join(folder, name) for name in [*dirnames, *filenames] if is_staging_name(name)]
            dirnames[:] = [name for name in dirnames if not is_staging_name(name)]
            for path in staging:
                with suppress(FileNotFoundError):  # its writer finished or cleaned up meanwhile
                    if _newest_mtime(path) < cutoff:
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                        removed.append(path)
        return removed

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        try:
            return self.write(self.path(key), [data], place=os.link)[0]
        except FileExistsError:
            return None

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = absent_is_none(Path(self.path(key)).read_bytes)
        return None if data is None else (data, sha256_hex(data))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        with _locked_at(self.path(key), version) as unchanged:
            return self.write(self.path(key), [data])[0] if unchanged else None

    def delete_if(self, key: str, version: str) -> bool:
        with _locked_at(self.path(key), version) as unchanged:
            if unchanged:
                os.remove(self.path(key))
                _fsync_dir(os.path.dirname(self.path(key)))
        return unchanged


@contextmanager
def _locked_at(path: str, version: str) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` beside ``path``; yield whether the object is still at
    ``version`` (False, with no lock taken, if it is absent). The lock file is never deleted: removing it could
    let two processes lock two different files of one name; the kernel drops a killed process's lock."""
    if not os.path.isfile(path):  # absent (its folder too, perhaps): nothing to lock
        yield False
        return
    folder, name = os.path.split(path)
    fd = os.open(os.path.join(folder, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        current = absent_is_none(Path(path).read_bytes)
        yield current is not None and sha256_hex(current) == version
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
    below = (os.path.join(folder, name) for folder, dirs, files in os.walk(path) for name in [*dirs, *files])
    return max([os.lstat(path).st_mtime, *(os.lstat(entry).st_mtime for entry in below)])

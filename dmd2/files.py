"""Writing local files and directories atomically: a reader (or a crash) never sees a partial one.

Everything the project writes outside the artifact store (caches, exports, sample grids, .npz files)
goes through these two helpers. The store has its own durable writes (`infra.store.local`).
"""

import os
import shutil
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed over `path`, on error deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(path, "tmp")
    # Created with the umask's mode, as a plain open() would (mkstemp's 0600 would survive the rename and
    # leave outputs unreadable to the rest of a team).
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    umask_mode = stat.S_IMODE(os.stat(tmp).st_mode)
    try:
        yield Path(tmp)
        os.chmod(tmp, umask_mode)  # the writer may have replaced it with a private file (see _as_plain_writes)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory beside `path`; on success it becomes `path`.

    `path` must not exist yet (a directory cannot be renamed over a non-empty one atomically). If
    another writer completed `path` meanwhile, its copy is kept and the staging copy dropped.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _hidden_sibling(path, "staging")
    staging.mkdir()  # the umask's mode (mkdtemp's is 0700)
    try:
        yield staging
        _as_plain_writes(staging)
        staging.rename(path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not path.is_dir():  # not a concurrent writer that won the race
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _as_plain_writes(staging: Path) -> None:
    """Give everything below ``staging`` the mode a plain open() or mkdir() gives (``staging``'s own, made by
    mkdir). Libraries that write atomically themselves leave private files: safetensors >= 0.8 saves through a
    0600 temporary file (safetensors#782), so every save_pretrained weight file would be readable by its owner
    alone, and a team's shared cache of teachers unusable by the rest of the team."""
    dir_mode = stat.S_IMODE(staging.stat().st_mode)
    for folder, dirnames, filenames in os.walk(staging):
        for name in [*dirnames, *filenames]:
            entry = os.lstat(path := os.path.join(folder, name))
            if stat.S_ISDIR(entry.st_mode):
                os.chmod(path, dir_mode)
            elif stat.S_ISREG(entry.st_mode):  # not a link: chmod would follow it out of the staging folder
                os.chmod(path, dir_mode & 0o666 | stat.S_IMODE(entry.st_mode) & 0o111 & dir_mode)


def _hidden_sibling(path: Path, tag: str) -> Path:
    """A unique hidden name beside `path` for staging its write."""
    return path.parent / f".{path.name}.{tag}-{uuid.uuid4().hex[:12]}"

"""Writing local files and directories atomically: a reader (or a crash) never sees a partial one.

Everything the project writes outside the artifact store (caches, exports, sample grids, .npz files)
goes through these two helpers. The store has its own durable writes (`infra.store.local`).
"""

import os
import shutil
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
    try:
        yield Path(tmp)
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
        staging.rename(path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not path.is_dir():  # not a concurrent writer that won the race
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _hidden_sibling(path: Path, tag: str) -> Path:
    """A unique hidden name beside `path` for staging its write."""
    return path.parent / f".{path.name}.{tag}-{uuid.uuid4().hex[:12]}"

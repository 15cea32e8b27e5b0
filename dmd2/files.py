"""Writing local files and directories atomically: a reader (or a crash) never sees a partial one.

Everything the project writes outside the artifact store (caches, exports, sample grids, .npz files)
goes through these two helpers. The store has its own durable writes (`infra.store.local`).
"""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed over `path`, on error deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
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
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.staging-", dir=path.parent))
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

"""New MLflow databases for the tests, made by copying one that MLflow has set up once per test process.

MLflow migrates every new sqlite database to its schema (~1 s, a few dozen migrations); an end-to-end test that
needs a database of its own gets a copy of one already migrated, which MLflow opens as it would any database of
this version. A test of how MLflow meets a missing database (the CLI's, in a user's fresh directory) uses a path
of its own instead.
"""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


@functools.cache
def _migrated() -> Path:
    from mlflow import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="dmd2-tests-mlflow-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()  # creates and migrates it
    return folder / "mlflow.db"


def tracking_uri_in(folder: Path) -> str:
    """The tracking URI of the MLflow database ``<folder>/mlflow.db``; made (a migrated copy) if there is none yet,
    as MLflow makes one where there is none."""
    database = Path(folder) / "mlflow.db"
    if not database.exists():
        shutil.copyfile(_migrated(), database)
    return f"sqlite:///{database}"

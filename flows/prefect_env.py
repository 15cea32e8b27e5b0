"""The Prefect settings the `dmd2` command starts with, each unless the environment already sets it.

They must be in the environment before Prefect is imported (it reads its settings then), and they
reach the local Prefect server that a run without PREFECT_API_URL starts, as its environment. A
dedicated server (`prefect server start`) takes the server-side ones from its own environment:
docs/deployments.md says which are worth setting there.
"""

import os

DEFAULTS = {
    # A local Prefect server's telemetry only fails on a machine without internet.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect logs every task run at INFO; the run prints its own progress.
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # A fresh PREFECT_HOME's server first migrates its database: 10-30 s on a busy two-core machine,
    # past Prefect's default 20 s wait.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # The server records a task run's states from the events its client sends, one database transaction
    # per event by default: about 25 per rollout, which on sqlite hold up the next rollout's API calls.
    # In batches flushed every second, the UI still shows each task's state within a second.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}


def apply_defaults() -> None:
    """Set each of `DEFAULTS` that the environment does not set already."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)

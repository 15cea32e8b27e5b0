"""The Prefect settings the `dmd2` command starts with, each unless the environment already sets it, and the local
Prefect server it starts where no Prefect API is set (`start_local_server`).

The settings must be in the environment before Prefect is imported (it reads its settings then), and they
reach the local Prefect server that a run without PREFECT_API_URL starts, as its environment. A
dedicated server (`prefect server start`) takes the server-side ones from its own environment:
docs/deployments.md says which are worth setting there.
"""

import atexit
import os
import subprocess
import sys

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


# Beside the CLI: once the CLI is gone (its parent pid changes), stop the server it started. SIGINT is ignored: Ctrl-C
# reaches the whole foreground group, and the CLI, still up, stops both itself.
_WATCHER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
cli, server = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == cli:
    time.sleep(1)
try:
    os.kill(server, signal.SIGTERM)
except ProcessLookupError:
    pass
"""


def start_local_server() -> None:
    """Where no Prefect API is set, start Prefect's local server now (the one its first API call would start) with a
    watcher that stops it once this process is gone. Prefect stops it at exit and on SIGTERM, but a SIGKILLed CLI (the
    OOM killer, `kill -9`) would leave it serving for ever, a port and ~250 MB each. The watcher is stopped at this
    process's exit, before the server (atexit runs last-registered first), so it acts only when exit hooks did not run.
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    server = SubprocessASGIServer()  # Prefect's own instance: its clients find it started
    server.start()
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()), str(server.server_process.pid)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(watcher.kill)

"""The local Prefect server a `dmd2` command starts where no Prefect API is set ends with the command, however it ends:
at exit (Prefect's own hook: tests/flows/test_cli_twice.py checks that the CLI leaves nothing running), and SIGKILLed
too (`flows.prefect_env.start_local_server`'s watcher), when no exit hook runs. Real processes: a Python that starts
the server as `dmd2 distill` does, then is killed."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What `_distill` does before the flow starts; then it prints the server's pid and waits to be killed.
COMMAND = """
import time
from flows.prefect_env import apply_defaults
apply_defaults()
from flows.prefect_env import start_local_server
from prefect.server.api.server import SubprocessASGIServer
start_local_server()
print(SubprocessASGIServer().server_process.pid, flush=True)
time.sleep(600)
"""


def start_command(tmp_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DMD2_"))}
    env |= {"PREFECT_HOME": str(tmp_path / ".prefect"), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", COMMAND], env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_killed_command_leaves_no_prefect_server_behind(tmp_path):
    command = start_command(tmp_path)
    try:
        server = int(command.stdout.readline())  # up: the command waits now
        os.kill(command.pid, signal.SIGKILL)  # the command alone, as the OOM killer would
        command.wait()
        assert gone_within(server, 15), "the server outlived the command that started it"
    finally:
        kill_group(command)


def kill_group(command: subprocess.Popen) -> None:
    """Whatever is left of the command's process group (nothing, where the test passes)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(command.pid, signal.SIGKILL)
    command.wait()

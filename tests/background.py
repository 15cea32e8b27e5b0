"""Set-up that needs CPU but no server, started in a subprocess once the session's tests are collected, and
waited for by the fixture that needs it.

The suite spends much of its time waiting on Ray, Prefect and CLI subprocesses, with a core idle: a long
self-contained set-up (training a teacher) runs there instead of on the suite's critical path. The job runs in
Linux's idle scheduling class, so the tests' own work comes first (merely niced, it slowed the tests beside it by
15-25%); a test run alone starts it too, and simply waits for it.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_jobs: dict[str, tuple[subprocess.Popen, Path]] = {}


def start(name: str, code: str) -> None:
    """Run ``code`` (Python, from the repository's root; ``sys.argv[1]`` is a new folder of its own for what it
    makes) as job ``name``: one torch thread, at the lowest priority."""
    folder = Path(tempfile.mkdtemp(prefix="dmd2-tests-job-"))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(folder / "stderr.log", "w") as log:  # a file, not a pipe: a progress bar never blocks on it
        job = subprocess.Popen([sys.executable, "-c", f"import torch; torch.set_num_threads(1)\n{code}",
                                str(folder)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
                               preexec_fn=_lowest_priority)
    _jobs[name] = job, folder


def _lowest_priority() -> None:
    """Linux's idle class where there is one (the job runs only when a core is free), else the lowest nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def wait(name: str, timeout_s: float = 1800) -> Path:
    """Block until job ``name`` has ended; its folder. The end of its stderr is in the failure if it failed."""
    assert name in _jobs, f"background job {name!r} was not started (tests/conftest.py starts it on collection)"
    job, folder = _jobs[name]
    job.wait(timeout=timeout_s)
    assert job.returncode == 0, (f"background job {name!r} failed ({job.returncode}):\n"
                                 f"{(folder / 'stderr.log').read_text()[-4000:]}")
    return folder


def stop_all() -> None:
    """End every job still running (a session that ended early, or never reached the job's test); remove the
    jobs' folders."""
    for job, folder in _jobs.values():
        if job.poll() is None:
            job.kill()
        job.wait()
        shutil.rmtree(folder, ignore_errors=True)
    _jobs.clear()

"""Work that needs CPU but no server, run in subprocesses beside the session's tests.

The suite spends much of its time waiting on Ray, Prefect and CLI subprocesses, with a core idle (alone, the
session keeps ~1.3 of the two cores busy). Two kinds of work fill it instead of the suite's critical path, both in
Linux's idle scheduling class, so the tests' own work comes first (merely niced, a job slowed the tests beside it
by 15-25%):

- jobs: a long self-contained set-up (training a teacher, filling inductor's cache), its code in its module's
  `BACKGROUND_JOBS`, started once the tests are collected if a test marked `waits_for(name)` is to run, which
  then runs last and waits for it (at its own priority, if it is not done); a test run alone simply waits;
- the lane: the tests of `LANE` (no server, no session fixture, no deadline or clock: a test starved of CPU for a
  while must not fail), run by a second pytest beside the session's other tests; its report follows the
  session's, and its failures fail the session. DMD2_TESTS_LANE=off runs them in the session instead.

The session's own tests split into two pytests at normal priority was tried (BENCHMARKS.md, seventh session): no
clear gain on a CPU-bound machine, and tests with deadlines failed under the contention.

Every test process, and every process it starts (Ray's ranks, the CLIs), waits for work with OpenMP's passive
policy (`OMP_WAIT_POLICY`, set in tests/conftest.py before torch is imported): by default an idle torch thread
spins, and at idle priority beside a busy core that tripled a test's CPU time (BENCHMARKS.md).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Pure torch by design (tests/dmd2/test_purity.py), or checked so (their stages' memory, `dmd2 plan`, MLflow on
# sqlite, the layout): ~350 core-s (4 minutes alone), which fit in the session's idle moments.
LANE = ("tests/dmd2/", "tests/infra/trainers/test_memory_plan.py", "tests/flows/test_plan.py",
        "tests/infra/tracking/test_runs.py", "tests/infra/tracking/test_registry.py", "tests/bench/test_memory_bench.py",
        "tests/test_layout.py")
LANE_SWITCH = "DMD2_TESTS_LANE"
_jobs: dict[str, tuple[subprocess.Popen, Path]] = {}
_lane: list[tuple[subprocess.Popen, Path]] = []


def start(name: str, code: str) -> None:
    """Run ``code`` (Python, from the repository's root; ``sys.argv[1]`` is a new folder of its own for what it
    makes) as job ``name``: one torch thread (unless ``code`` sets more), at the lowest priority."""
    folder = Path(tempfile.mkdtemp(prefix="dmd2-tests-job-"))
    _jobs[name] = _spawn([sys.executable, "-c", f"import torch; torch.set_num_threads(1)\n{code}", str(folder)],
                         folder / "output.log", REPO, {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}), folder


def _spawn(args: list[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``args`` at the lowest priority, in ``cwd`` with ``env`` added to this environment, its output in ``log``: a
    file, not a pipe, so that a progress bar or a long report never blocks on it."""
    with open(log, "w") as out:
        return subprocess.Popen(args, cwd=cwd, env=os.environ | env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=_lowest_priority)


def _lowest_priority() -> None:
    """Linux's idle class where there is one (the job runs only when a core is free), else the lowest nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _take_my_priority(pid: int) -> None:
    """Give every thread of process ``pid`` this process's scheduling class (none in the lane, itself idle)."""
    if not hasattr(os, "sched_getscheduler") or (policy := os.sched_getscheduler(0)) == os.SCHED_IDLE:
        return
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(thread), policy, os.sched_param(0))
        except (ProcessLookupError, PermissionError):  # ended meanwhile, or not ours to change
            pass


def wait(name: str, timeout_s: float = 1800) -> Path:
    """Block until job ``name`` has ended; its folder. The end of its output is in the failure if it failed."""
    assert name in _jobs, f"background job {name!r} was not started (tests/conftest.py starts it on collection)"
    job, folder = _jobs[name]
    if job.poll() is None:
        _take_my_priority(job.pid)  # a test now waits for it: it runs as the test would
    job.wait(timeout=timeout_s)
    assert job.returncode == 0, (f"background job {name!r} failed ({job.returncode}):\n"
                                 f"{(folder / 'output.log').read_text()[-4000:]}")
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


def split_lane(items: list) -> list:
    """The items of ``LANE`` taken out of ``items`` (in place), when the session also runs others (a lane alone runs
    in the session); none in the lane's own pytest, or with DMD2_TESTS_LANE=off."""
    switch = os.environ.get(LANE_SWITCH, "")
    if switch not in ("", "off", "lane"):
        raise pytest.UsageError(f"{LANE_SWITCH}={switch!r}: leave it unset (the lane runs beside the session) or set "
                                "it to off (its tests run in the session)")
    if switch:
        return []
    lane = [item for item in items if item.nodeid.startswith(LANE)]
    if not lane or len(lane) == len(items):
        return []
    items[:] = [item for item in items if not item.nodeid.startswith(LANE)]
    return lane


def start_lane(nodeids: list[str], rootdir: Path) -> None:
    """Run the tests ``nodeids`` in a second pytest at the lowest priority, its report kept in a file."""
    folder = Path(tempfile.mkdtemp(prefix="dmd2-tests-lane-"))
    _lane.append((_spawn([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
                         folder / "report.txt", rootdir, {LANE_SWITCH: "lane"}), folder))


def wait_lane(stop: bool = False) -> tuple[int, str] | None:
    """(exit code, report) of the lane once it has ended (``stop``: ended now); None if none was started."""
    if not _lane:
        return None
    lane, folder = _lane.pop()
    try:
        if stop:
            _interrupt(lane)
        lane.wait()
    except KeyboardInterrupt:  # Ctrl-C while the session waits for it
        _interrupt(lane)
        raise
    report = (folder / "report.txt").read_text()
    shutil.rmtree(folder, ignore_errors=True)
    return lane.returncode, report


def _interrupt(process: subprocess.Popen) -> None:
    """End a pytest as Ctrl-C does (its session ends and stops its own jobs); killed if it takes over a minute."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

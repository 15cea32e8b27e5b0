"""What a rollout's Prefect bookkeeping costs alone: a parent flow runs empty child flows of eight tasks
each (a rollout's shape, no training), against a local Prefect server, under each setting of issue 15.

    python bench/prefect_subflow.py [--children 12] [--modes default,no-heartbeat,batched,dmd2]

Modes (each in a fresh process, so that its server starts with its settings):
- default:      Prefect's defaults (each child flow run heartbeats; task runs recorded event by event)
- no-heartbeat: the children without their own heartbeat, as the distill flow runs its rollouts
- batched:      no heartbeat, and the server records task runs in batches (flows/prefect_env.py)
- dmd2:         everything `dmd2` sets (batched, and logging at WARNING)

Prints per mode the median seconds per child flow run (children after the first two) and the CPU
seconds per child of this process and of the server's.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: make the repo importable

MODES = ("default", "no-heartbeat", "batched", "dmd2")


def child_process(mode: str, children: int) -> None:
    """One mode's measurement; runs in its own process (Prefect reads its settings at import)."""
    if mode in ("batched", "dmd2"):
        from flows.prefect_env import DEFAULTS
        names = DEFAULTS if mode == "dmd2" else [n for n in DEFAULTS if "TASK_RUN_RECORDER" in n]
        os.environ.update({name: DEFAULTS[name] for name in names})
    import contextlib

    import psutil
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    @task(cache_policy=NO_CACHE)
    def stage(i: int) -> dict:
        return {"i": i}

    @flow(name="child", flow_run_name="child-{i}")
    def child(i: int) -> list:
        return [stage(i) for _ in range(8)]

    def cpu_seconds(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    @flow(name="parent")
    def parent() -> None:
        me = psutil.Process()
        server = me.children(recursive=True)  # started for this flow run, when PREFECT_API_URL is unset
        before = cpu_seconds(me), sum(cpu_seconds(p) for p in server)
        seconds = []
        for i in range(children):
            started = time.perf_counter()
            with (contextlib.nullcontext() if mode == "default"
                  else temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})):
                child(i)
            seconds.append(time.perf_counter() - started)
        after = cpu_seconds(me), sum(cpu_seconds(p) for p in server)
        print(f"{mode:<13} {statistics.median(seconds[2:]):7.3f} s per child flow run   CPU per child: this "
              f"process {(after[0] - before[0]) / children:.3f} s, server {(after[1] - before[1]) / children:.3f} s"
              f"   (each: {' '.join(f'{s:.2f}' for s in seconds)})", flush=True)

    parent()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=12)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one mode's process
    args = parser.parse_args()
    if args.child:
        return child_process(args.child, args.children)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.children < 4:
        parser.error("--children must be >= 4: the first two are not counted")
    for mode in modes:
        with tempfile.TemporaryDirectory() as home:  # a fresh server database per mode
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env |= {"PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
            result = subprocess.run([sys.executable, __file__, "--child", mode, "--children", str(args.children)],
                                    env=env, capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith(mode)]
            print(lines[-1] if lines else f"{mode}: failed\n{result.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()

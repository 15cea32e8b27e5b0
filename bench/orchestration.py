"""What orchestration costs per rollout: the distill flow (Prefect + Ray + store + MLflow) against the
in-process loop, on the same recipe, seed and machine, measured in one run.

    python bench/orchestration.py [--recipe recipes/digits-4step.toml] [--rollouts 30] [--rollout-heartbeat]

The in-process loop runs before and after the flow (the machine's load can drift: both are printed,
their mean is the baseline). Start-up (Ray, groups, Prefect) is excluded: per-rollout figures come
from the time between the first and the last rollout. Then where the flow's time per rollout goes:

- compute: the in-process loop's time;
- the tasks beyond it: Ray calls, and the ranks' store reads and writes (the tasks' wall times, from
  the run's MLflow metrics, less the compute);
- Prefect: each rollout flow run's wall time beyond its tasks, with its API requests (count, time)
  and the heartbeat's stop; `--rollout-heartbeat` gives the rollout flow runs their own heartbeat
  again, as before issue 15, to show what it cost;
- MLflow: the distill flow's metric calls per rollout;
- the rest of the distill loop (the run lease's check, pruning old rollouts, the progress bar);
- the store on its own: one rollout's payloads written and read once, durable (fsynced) and as
  the ranks write them (not), timed here in the driver.

The Prefect settings are the `dmd2` command's (`flows.prefect_env`). The timers wrap functions of this
process only to time them; nothing is replaced.
"""

import argparse
import contextlib
import inspect
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the repo importable

from flows.prefect_env import apply_defaults  # noqa: E402

apply_defaults()  # before Prefect is imported, as the dmd2 command does

import prefect.client.base  # noqa: E402
import prefect.flow_engine  # noqa: E402
import safetensors.torch  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import flows.distill  # noqa: E402
from dmd2.family import default_cache_dir  # noqa: E402
from dmd2.loop import InProcessDistiller  # noqa: E402
from flows.recipe import RECIPES, run_config  # noqa: E402
from infra.store import ArtifactStore  # noqa: E402
from infra.tracking.runs import RunTracker  # noqa: E402

RUN_ID = "bench"


def in_process_seconds(recipe: Path, rollouts: int, cache_dir: Path) -> float:
    config, family = run_config(recipe, rollouts=rollouts)
    config = family.resolve(config, cache_dir)
    distiller = InProcessDistiller.for_family(config, family, cache_dir)
    stamps = []
    distiller.run(range(rollouts), lambda rollout, metrics: stamps.append(time.monotonic()))
    return (stamps[-1] - stamps[0]) / (rollouts - 1)


class Timers:
    """Seconds and calls per name, summed from the end of the first rollout flow run on, as the per-rollout
    figures are (`timed` wraps a function)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.in_rollout_flow = False
        self.rollouts_done = 0

    def add(self, name: str, seconds: float) -> None:
        if self.rollouts_done >= 1:
            self.seconds[name] += seconds
            self.calls[name] += 1

    def timed(self, owner, attribute: str, name: str, counts=lambda: True) -> None:
        """Wrap `owner.attribute` (a function or an async function) to add its time under `name` whenever
        `counts()` says so."""
        original = getattr(owner, attribute)

        def sync_wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if counts():
                    self.add(name, time.perf_counter() - started)

        async def async_wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                if counts():
                    self.add(name, time.perf_counter() - started)

        setattr(owner, attribute, async_wrapper if inspect.iscoroutinefunction(original) else sync_wrapper)


def instrument(timers: Timers, rollout_heartbeat: bool) -> None:
    """Time the rollout flow runs, their Prefect API requests and heartbeat stops, and the MLflow calls."""
    # With `rollout_heartbeat`, as before issue 15: the rollout flow runs are called with Prefect's settings.
    if rollout_heartbeat:
        flows.distill.rollouts_without_heartbeat = contextlib.nullcontext
    rollout = flows.distill.rollout_flow

    def timed_rollout(run_id, rollout_id):
        timers.in_rollout_flow = True
        started = time.perf_counter()
        try:
            return rollout(run_id, rollout_id)
        finally:
            timers.add("rollout flow run", time.perf_counter() - started)
            timers.in_rollout_flow = False
            timers.rollouts_done += 1

    flows.distill.rollout_flow = timed_rollout  # the name the distill loop calls
    # The requests a rollout flow run waits for; the background log and event workers' are not among them.
    waited_for = lambda: timers.in_rollout_flow and "Worker" not in threading.current_thread().name  # noqa: E731
    for client in (prefect.client.base.PrefectHttpxSyncClient, prefect.client.base.PrefectHttpxAsyncClient):
        timers.timed(client, "send", "Prefect API requests", waited_for)
    heartbeats = prefect.flow_engine._send_heartbeats

    @contextlib.contextmanager
    def timed_heartbeats(engine, join_on_exit=True):
        with heartbeats(engine, join_on_exit) as value:
            try:
                yield value
            finally:
                stopping = time.perf_counter()
        if timers.in_rollout_flow:
            timers.add("heartbeat stop", time.perf_counter() - stopping)
    prefect.flow_engine._send_heartbeats = timed_heartbeats
    timers.timed(RunTracker, "queue_metrics", "MLflow")


def flow_seconds(recipe: Path, rollouts: int, workdir: Path, cache_dir: Path) -> tuple[float, dict[str, float]]:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    result = flows.distill.distill(recipe=str(recipe), run_id=RUN_ID, rollouts=rollouts,
                                   store_uri=(workdir / "store").as_uri(), tracking_uri=uri,
                                   cache_dir=str(cache_dir), output_dir=str(workdir / "out"))
    client = MlflowClient(uri)
    losses = client.get_metric_history(result["mlflow_run_id"], "train/loss")
    stamps = sorted(m.timestamp for m in losses)
    run = client.get_run(result["mlflow_run_id"])
    tasks = {key: statistics.mean(m.value for m in client.get_metric_history(run.info.run_id, key))
             for key in run.data.metrics if key.startswith("time/")}
    return (stamps[-1] - stamps[0]) / 1000 / (len(stamps) - 1), tasks


def store_seconds(store_root: Path, repeats: int = 10) -> tuple[int, int, float, float]:
    """One rollout's payloads (the newest kept), written and read `repeats` times, durable and not:
    (objects, bytes, seconds durable, seconds not durable) per rollout."""
    store = ArtifactStore(store_root.as_uri())
    newest = store_root / RUN_ID / f"rollout-{store.list_rollouts(RUN_ID)[-1]}"
    payloads = [safetensors.torch.load_file(path) for path in sorted(newest.rglob("*.safetensors"))]
    nbytes = sum(path.stat().st_size for path in newest.rglob("*.safetensors"))
    seconds = []
    for durable in (True, False):
        started = time.perf_counter()
        for repeat in range(repeats):
            for index, tensors in enumerate(payloads):
                ref = store.put_tensors(f"scratch/{int(durable)}/{repeat}/{index}.safetensors", tensors, durable)
                store.get_tensors(ref)
        seconds.append((time.perf_counter() - started) / repeats)
    return len(payloads), nbytes, seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPES / "digits-4step.toml")
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--rollout-heartbeat", action="store_true",
                        help="give each rollout flow run its own heartbeat (as before issue 15)")
    args = parser.parse_args()
    if args.rollouts < 3:
        parser.error("--rollouts must be >= 3: per-rollout times come from the rollouts after the first")
    before = in_process_seconds(args.recipe, args.rollouts, args.cache_dir)
    timers = Timers()
    instrument(timers, args.rollout_heartbeat)
    with tempfile.TemporaryDirectory() as workdir:
        flow, tasks = flow_seconds(args.recipe, args.rollouts, Path(workdir), args.cache_dir)
        objects, nbytes, durable, not_durable = store_seconds(Path(workdir) / "store")
    after = in_process_seconds(args.recipe, args.rollouts, args.cache_dir)
    baseline = (before + after) / 2
    per_rollout = {name: seconds / (args.rollouts - 1) for name, seconds in timers.seconds.items()}
    tasks_sum = sum(tasks.values())
    flow_run = per_rollout["rollout flow run"]
    requests = timers.calls["Prefect API requests"] / (args.rollouts - 1)
    rows = [
        ("compute (the in-process loop)", baseline),
        ("tasks beyond the compute: Ray calls, the ranks' store I/O", tasks_sum - baseline),
        ("Prefect: the rollout flow run beyond its tasks", flow_run - tasks_sum),
        (f"  of which API requests waited for ({requests:.0f} per rollout)", per_rollout["Prefect API requests"]),
        ("  of which the heartbeat's stop", per_rollout.get("heartbeat stop", 0.0)),
        ("MLflow: the metrics of a rollout (queued, sent every few seconds)", per_rollout["MLflow"]),
        ("the rest of the distill loop (lease, pruning, progress)", flow - flow_run - per_rollout["MLflow"]),
    ]
    print(f"recipe {args.recipe.name}, {args.rollouts} rollouts"
          f"{', rollout flow runs with their own heartbeat' if args.rollout_heartbeat else ''}")
    # The two summary lines keep their form, so that runs compare over time.
    print(f"in-process loop : {baseline:.3f} s/rollout")
    print(f"distill flow    : {flow:.3f} s/rollout  (ratio flow / in-process {flow / baseline:.2f})")
    print(f"the flow's cost : {flow - baseline:+.3f} s/rollout; the in-process loop took {before:.3f} s/rollout "
          f"before the flow, {after:.3f} after")
    print("where the distill flow's time per rollout goes:")
    for name, seconds in rows:
        print(f"  {name:<66} {seconds:7.3f} s")
    print("  the tasks' wall times:")
    for key, seconds in sorted(tasks.items()):
        print(f"    {key:<64} {seconds:7.3f} s")
    print(f"store alone: a rollout's {objects} payloads ({nbytes / 2**20:.2f} MiB) written and read once: "
          f"{durable:.4f} s fsynced, {not_durable:.4f} s as the ranks write them (not fsynced)")


if __name__ == "__main__":
    main()

"""How a rollout scales: seconds per rollout against samples per rollout (x1, x2, x4 of the recipe's
`[train] rollout_batch_size`) and world size (1, 2), and the peak host memory of the driver and of each rank.

    python bench/scale.py [--recipe recipes/digits-4step.toml] [--rollouts 6] [--world-sizes 1,2]
                          [--multipliers 1,2,4,8] [--cache-dir DIR]

Each configuration builds the trainer groups as the distill flow does (`build_groups`, on a temporary
`file://` store) and drives them with `run_rollout_on_groups`, the stages the flow's tasks call: the
driver passes references only, so its memory must not grow with the payload. Seconds per rollout come
from the rollouts after the first (warm); growth is against x1 at the same world size (linear would be xN).
The driver's figure is the peak of its RSS sampled every 50 ms while the configuration runs (building the
groups, the rollouts, shutting them down), with its growth over the RSS before; each rank's is its
process's VmHWM (the peak RSS of its life: start-up, models, rollouts). x8 runs at world size 1 only: it is
there for the last line, the driver's peak at x8 over x1.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the repo importable

import ray  # noqa: E402

from dmd2.config import DistillConfig  # noqa: E402
from dmd2.family import ModelFamily, default_cache_dir  # noqa: E402
from flows.recipe import RECIPES, run_config  # noqa: E402
from infra.store import ArtifactStore  # noqa: E402
from infra.trainers import Groups, build_groups, ensure_ray, prepare_inputs, run_rollout_on_groups  # noqa: E402

MiB = 2**20
DRIVER_CHECK = 8  # the multiplier whose driver peak is set against x1's (world size 1 only)


def status_bytes(key: str) -> int:
    """A field of this process's /proc/self/status (VmRSS, VmHWM; kB there), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRSS:
    """This process's peak RSS while the block runs, sampled every 50 ms. ru_maxrss (and VmHWM) is the peak
    of the process's whole life, so it cannot tell a configuration from the ones before it."""

    def __enter__(self) -> "PeakRSS":
        self.before = self.peak = status_bytes("VmRSS")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, status_bytes("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, status_bytes("VmRSS"))


def rank_peaks(groups: Groups) -> dict[str, list[int]]:
    """Each rank's VmHWM per role, read in the rank's own process through Ray's `__ray_call__` (it runs a
    function on the actor, so no rank method and no pid is needed, and it works on any node)."""
    return {group.role: ray.get([rank.__ray_call__.remote(lambda worker: status_bytes("VmHWM"))
                                 for rank in group.ranks])
            for group in groups.in_order()}


@dataclass(frozen=True)
class Row:
    """One configuration's figures (memory in bytes)."""

    world_size: int
    multiplier: int
    samples: int
    durations: tuple[float, ...]  # every rollout's, the first (cold) included
    driver_peak: int
    driver_growth: int
    ranks: dict[str, list[int]]

    @property
    def seconds(self) -> float:
        return statistics.mean(self.durations[1:])


def measure(config: DistillConfig, family: ModelFamily, cache_dir: Path, store: ArtifactStore, rollouts: int,
            multiplier: int) -> Row:
    """`rollouts` rollouts of `config` on fresh groups, which end with it."""
    world = config.train.world_size
    prepared, _ = prepare_inputs(family, config, store)
    spec = dataclasses.replace(family.run_spec(config, cache_dir), prepared=prepared)
    run_id, durations = f"scale-ws{world}-x{multiplier}", []
    with PeakRSS() as driver:
        groups = build_groups(spec, store, num_threads=max(1, (os.cpu_count() or 1) // world))  # as the flow
        try:
            for rollout in range(rollouts):
                start = time.perf_counter()
                run_rollout_on_groups(groups, run_id, rollout)
                durations.append(time.perf_counter() - start)
            ranks = rank_peaks(groups)  # before shutdown: the processes end with the groups
        finally:
            groups.shutdown()
    return Row(world, multiplier, config.train.rollout_batch_size, tuple(durations), driver.peak,
               driver.peak - driver.before, ranks)


def table(rows: list[Row]) -> str:
    x1 = {row.world_size: row.seconds for row in rows if row.multiplier == 1}
    lines = ["| config | samples per rollout | s/rollout | growth vs x1 | driver peak MiB (growth) | rank peaks MiB |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        growth = f"{row.seconds / x1[row.world_size]:.2f}" if row.world_size in x1 else "n/a"
        ranks = "; ".join(f"{role} " + ", ".join(f"{peak / MiB:.0f}" for peak in peaks)
                          for role, peaks in row.ranks.items())
        lines.append(f"| world size {row.world_size}, x{row.multiplier} | {row.samples} | {row.seconds:.3f} | "
                     f"{growth} | {row.driver_peak / MiB:.0f} ({row.driver_growth / MiB:+.0f}) | {ranks} |")
    return "\n".join(lines)


def driver_check(rows: list[Row]) -> str:
    peaks = {row.multiplier: row for row in rows if row.world_size == 1}
    if 1 not in peaks or DRIVER_CHECK not in peaks:
        return f"driver peak x{DRIVER_CHECK} / x1: not measured (needs world size 1 with x1 and x{DRIVER_CHECK})"
    low, high = peaks[1], peaks[DRIVER_CHECK]
    return (f"driver peak x{DRIVER_CHECK} / x1: {high.driver_peak / low.driver_peak:.3f} "
            f"(growth during the configuration: x1 {low.driver_growth / MiB:+.0f} MiB, "
            f"x{DRIVER_CHECK} {high.driver_growth / MiB:+.0f} MiB)")


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPES / "digits-4step.toml")
    parser.add_argument("--rollouts", type=int, default=6, help="per configuration; the first is not timed")
    parser.add_argument("--world-sizes", type=numbers, default=[1, 2])
    parser.add_argument("--multipliers", type=numbers, default=[1, 2, 4, DRIVER_CHECK],
                        help="of the recipe's rollout_batch_size")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    if args.rollouts < 2:
        parser.error("--rollouts must be >= 2: the first rollout is not timed")
    config, family = run_config(args.recipe)
    config = family.resolve(config, args.cache_dir)
    # Ray's CPUs are logical: two colocated groups ask for cpus_per_rank per rank each, and the ranks share
    # the machine's cores as a local run's do.
    ensure_ray(num_cpus=max(os.cpu_count() or 1, 2 * max(args.world_sizes)), log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        store = ArtifactStore((Path(workdir) / "store").as_uri())
        for world in args.world_sizes:
            for multiplier in args.multipliers:
                if multiplier == DRIVER_CHECK and world > 1:
                    continue
                scaled = config.replace("train", world_size=world,
                                        rollout_batch_size=config.train.rollout_batch_size * multiplier)
                rows.append(measure(scaled, family, args.cache_dir, store, args.rollouts, multiplier))
                each = ", ".join(f"{seconds:.2f}" for seconds in rows[-1].durations)
                print(f"measured world size {world}, x{multiplier}: {rows[-1].seconds:.3f} s/rollout warm "
                      f"(each rollout: {each} s)", file=sys.stderr, flush=True)
    print(f"recipe {args.recipe.name}, {args.rollouts} rollouts per configuration, {os.cpu_count()} cores")
    print(table(rows))
    print(driver_check(rows))


if __name__ == "__main__":
    main()

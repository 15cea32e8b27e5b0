"""Does a checkpoint slow the rollouts after it? Seconds per rollout before and after `save_groups`, one run.

    python bench/after_checkpoint.py [--rollouts 40] [--recipe recipes/digits-4step.toml]

The trainer groups are built as the distill flow builds them (`build_groups`, a temporary `file://` store, all
cores' threads per rank) and driven by `run_rollout_on_groups`, the stages the flow's tasks call; a checkpoint
of every group is saved after `--rollouts` rollouts, then as many run again. Printed: the mean seconds per
rollout before and after (each leaving out its first rollout) and their ratio. Before issue 15's fix, DCP's
planning collectives at world size 1 left libgomp without spinning threads, and the ratio was ~1.7 on two cores.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: make the repo importable

from dmd2.family import default_cache_dir  # noqa: E402
from flows.recipe import run_config  # noqa: E402
from infra.store import ArtifactStore  # noqa: E402
from infra.trainers import build_groups, ensure_ray, prepare_inputs, run_rollout_on_groups, save_groups  # noqa: E402


def seconds_per_rollout(groups, first: int, count: int) -> float:
    durations = []
    for rollout in range(first, first + count):
        started = time.perf_counter()
        run_rollout_on_groups(groups, "bench", rollout)
        durations.append(time.perf_counter() - started)
    return statistics.mean(durations[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "digits-4step.toml")
    parser.add_argument("--rollouts", type=int, default=40, help="rollouts before and after the checkpoint")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: dmd2.family.default_cache_dir()")
    args = parser.parse_args()
    if args.rollouts < 2:
        raise SystemExit("--rollouts must be at least 2")

    config, family = run_config(args.recipe, rollouts=2 * args.rollouts)
    cache_dir = args.cache_dir or default_cache_dir()
    config = family.resolve(config, cache_dir)
    ensure_ray(num_cpus=max(os.cpu_count() or 1, 2), log_to_driver=False)
    with tempfile.TemporaryDirectory() as workdir:
        store = ArtifactStore((Path(workdir) / "store").as_uri())
        prepared, _ = prepare_inputs(family, config, store)
        spec = dataclasses.replace(family.run_spec(config, cache_dir), prepared=prepared)
        world = config.train.world_size
        groups = build_groups(spec, store, num_threads=max(1, (os.cpu_count() or 1) // world))  # as the flow
        try:
            before = seconds_per_rollout(groups, 0, args.rollouts)
            started = time.perf_counter()
            save_groups(groups, "bench", args.rollouts)
            saved = time.perf_counter() - started
            after = seconds_per_rollout(groups, args.rollouts, args.rollouts)
        finally:
            groups.shutdown()
    print(f"{args.recipe.name}, world size {world}, {args.rollouts} rollouts each side of the checkpoint")
    print(f"before the checkpoint : {before:.3f} s/rollout")
    print(f"the checkpoint        : {saved:.3f} s")
    print(f"after the checkpoint  : {after:.3f} s/rollout  (ratio after / before {after / before:.2f})")


if __name__ == "__main__":
    main()

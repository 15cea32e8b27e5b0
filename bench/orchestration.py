"""What orchestration costs per rollout: the distill flow (Prefect + Ray + store) against the
in-process loop, on the same recipe, seed and machine, measured in one run.

    python bench/orchestration.py [--recipe recipes/digits-4step.toml] [--rollouts 30]

Prints seconds per rollout for both and their ratio, plus the flow's per-task wall times (from the
run's MLflow metrics). Start-up (Ray, groups, Prefect) is excluded: per-rollout figures come from the
time between the first and the last rollout.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the repo importable

from mlflow import MlflowClient  # noqa: E402

from dmd2.family import default_cache_dir  # noqa: E402
from dmd2.loop import InProcessDistiller  # noqa: E402
from flows.distill import distill  # noqa: E402
from flows.recipe import RECIPES, run_config  # noqa: E402


def in_process_seconds(recipe: Path, rollouts: int, cache_dir: Path) -> float:
    config, family = run_config(recipe, rollouts=rollouts)
    config = family.resolve(config, cache_dir)
    spec = family.run_spec(config, cache_dir)
    distiller = InProcessDistiller.from_models(config, family.load_model(config.model.teacher), spec.conds,
                                               spec.sample_shape)
    stamps = []
    distiller.run(range(rollouts), lambda rollout, metrics: stamps.append(time.monotonic()))
    return (stamps[-1] - stamps[0]) / (rollouts - 1)


def flow_seconds(recipe: Path, rollouts: int, workdir: Path, cache_dir: Path) -> tuple[float, dict[str, float]]:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    result = distill(recipe=str(recipe), run_id="bench", rollouts=rollouts, store_uri=(workdir / "store").as_uri(),
                     tracking_uri=uri, cache_dir=str(cache_dir), output_dir=str(workdir / "out"))
    client = MlflowClient(uri)
    losses = client.get_metric_history(result["mlflow_run_id"], "train/loss")
    stamps = sorted(m.timestamp for m in losses)
    run = client.get_run(result["mlflow_run_id"])
    tasks = {key: statistics.mean(m.value for m in client.get_metric_history(run.info.run_id, key))
             for key in run.data.metrics if key.startswith("time/")}
    return (stamps[-1] - stamps[0]) / 1000 / (len(stamps) - 1), tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPES / "digits-4step.toml")
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    baseline = in_process_seconds(args.recipe, args.rollouts, args.cache_dir)
    with tempfile.TemporaryDirectory() as workdir:
        flow, tasks = flow_seconds(args.recipe, args.rollouts, Path(workdir), args.cache_dir)
    print(f"recipe {args.recipe.name}, {args.rollouts} rollouts")
    print(f"in-process loop : {baseline:.3f} s/rollout")
    print(f"distill flow    : {flow:.3f} s/rollout  (ratio flow / in-process {flow / baseline:.2f})")
    for key, seconds in sorted(tasks.items()):
        print(f"  {key:<20} {seconds:.3f} s")
    print(f"  {'tasks, summed':<20} {sum(tasks.values()):.3f} s; the rest is Prefect's per-run bookkeeping")


if __name__ == "__main__":
    main()

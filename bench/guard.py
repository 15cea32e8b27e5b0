"""The collapse guard on healthy runs: does any rule trip, and what do its signals cost per rollout?

    python bench/guard.py [--seeds 0 1 2] [--rollouts N] [--recipes recipes/digits-4step.toml recipes/digits-1step.toml]
    python bench/guard.py --tiny ...   a small random digits UNet instead of the pretrained teacher (no pretraining)

Each recipe and seed runs in process under the guard (`dmd2.guarded_loop.GuardedRun`, the recipe's `[guard]`
defaults); printed: the trips (none expected), the closest each rule came (the worst ratio of a signal to its
limit), and the signals' cost: the mean seconds of `sample_signals` on the actor's batch plus the guard's
`observe`, over the mean seconds of the in-process rollout.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: make the repo importable

import torch  # noqa: E402

from dmd2.config import load_recipe  # noqa: E402
from dmd2.families.digits.data import IMAGE_SHAPE  # noqa: E402
from dmd2.families.digits.model import build_digits_unet  # noqa: E402
from dmd2.families.digits.yardstick import DIGIT_CONDS  # noqa: E402
from dmd2.family import default_cache_dir  # noqa: E402
from dmd2.guard import CollapseGuard, sample_signals  # noqa: E402
from dmd2.guarded_loop import GuardedRun  # noqa: E402
from dmd2.loop import InProcessDistiller  # noqa: E402


def teacher_of(config, tiny: bool) -> torch.nn.Module:
    if tiny:
        torch.manual_seed(0)
        return build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)
    from dmd2.families.digits.pretrain import resolve_model
    from dmd2.model import load_pretrained
    return load_pretrained(resolve_model(config.model.teacher, default_cache_dir())).eval()


def one_run(recipe: str, seed: int, rollouts: int | None, tiny: bool) -> dict[str, float]:
    config = load_recipe(recipe)
    config = config.replace("train", seed=seed, rollouts=rollouts or config.train.rollouts)
    distiller = InProcessDistiller.from_models(config, teacher_of(config, tiny), DIGIT_CONDS, IMAGE_SHAPE)
    guarded, times, rows = GuardedRun(distiller), [], []
    last = [time.perf_counter()]

    def on_rollout(rollout_id, metrics):
        now = time.perf_counter()
        times.append(now - last[0])
        rows.append(metrics)
        last[0] = now

    guarded.run(on_rollout)
    # the signals' cost, measured apart on a batch of the actor's size, and the guard's bookkeeping on the run's rows
    batch = torch.randn(config.critic_batch_size, *IMAGE_SHAPE)
    started = time.perf_counter()
    for _ in range(200):
        {key: float(value) for key, value in sample_signals(batch).items()}
    signals_s = (time.perf_counter() - started) / 200
    replay = CollapseGuard(config.guard, config.optim.grad_clip)
    started = time.perf_counter()
    for rollout_id, metrics in enumerate(rows):
        replay.observe(rollout_id, metrics)
    observe_s = (time.perf_counter() - started) / len(rows)
    rollout_s = statistics.mean(times[1:])
    return {"trips": len(guarded.events), "rollout_s": rollout_s, "signals_s": signals_s, "observe_s": observe_s,
            "cost": (signals_s + observe_s) / rollout_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["recipes/digits-4step.toml", "recipes/digits-1step.toml"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--tiny", action="store_true", help="a small random UNet teacher (no pretraining)")
    args = parser.parse_args()
    print("| recipe | seed | rollouts | trips | s / rollout | signals + guard, ms | cost |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for recipe in args.recipes:
        for seed in args.seeds:
            row = one_run(recipe, seed, args.rollouts, args.tiny)
            print(f"| {Path(recipe).name}{' (tiny teacher)' if args.tiny else ''} | {seed} | "
                  f"{args.rollouts or load_recipe(recipe).train.rollouts} | {row['trips']} | {row['rollout_s']:.3f} | "
                  f"{1e3 * (row['signals_s'] + row['observe_s']):.3f} | {row['cost']:.2%} |", flush=True)


if __name__ == "__main__":
    main()

"""The collapse guard on healthy runs: does any rule trip, and what do its signals cost per rollout?

    python bench/guard.py [--seeds 0 1 2] [--rollouts N] [--recipes recipes/digits-4step.toml recipes/digits-1step.toml]
    python bench/guard.py --tiny ...   a tiny random teacher of each recipe's family (no pretraining, no download):
                                       a small digits UNet, or the suite's tiny SD3, FLUX.1, FLUX.2 [klein],
                                       Qwen-Image or Wan pipeline at 16 px
    python bench/guard.py --set optim.lr=1e-3 ...   recipe options, as `dmd2 distill --set`

Each recipe and seed runs in process under the guard (`dmd2.guarded_loop.GuardedRun`, the recipe's `[guard]`
defaults), its model, conditioning and prepared inputs made by its family as the ranks make them; printed: the
trips (none expected), and the signals' cost: the mean seconds of `sample_signals` on the actor's batch plus the
guard's `observe`, over the mean seconds of the in-process rollout.
"""

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: make the repo importable

import torch  # noqa: E402

from dmd2.config import ConfigError, load_recipe, parse_overrides  # noqa: E402
from dmd2.family import default_cache_dir, family_for  # noqa: E402
from dmd2.guard import CollapseGuard, sample_signals  # noqa: E402
from dmd2.guarded_loop import GuardedRun  # noqa: E402
from dmd2.loop import InProcessDistiller  # noqa: E402

# A tiny pipeline's run, as the suite's end-to-end runs of each family make it: its own prompts, 16 px (video: 5
# frames), one rank, a small batch, `max_sequence_length` tokens of its text encoder.
TINY_PROMPTS = ["a photo of a cat", "a red dog", "a blue sign", "the cat on the sign", "a dog on the sign"]
TINY_RUN = ["train.world_size=1", "train.rollout_batch_size=8", "dmd2.critic_steps_per_rollout=2"]
TINY_PIPELINES = {  # family: (the tests' builder, its module, the options of its size)
    "sd3": ("build_tiny_sd3_pipeline", "tests.dmd2.families.sd3.tiny_pipeline", ["data.resolution=16"]),
    "flux": ("build_tiny_flux_pipeline", "tests.dmd2.families.flux.tiny_pipeline",
             ["data.resolution=16", "data.max_sequence_length=8"]),
    "qwen_image": ("build_tiny_qwen_image_pipeline", "tests.dmd2.families.qwen_image.tiny_pipeline",
                   ["data.resolution=16", "data.max_sequence_length=64"]),
    "flux2_klein": ("build_tiny_klein_pipeline", "tests.dmd2.families.flux.klein.tiny_pipeline",
                    ["data.resolution=16", "data.max_sequence_length=24"]),
    "wan": ("build_tiny_wan_pipeline", "tests.dmd2.families.wan.tiny_pipeline",
            ["data.frames=5", "data.height=16", "data.width=16", "data.max_sequence_length=8"]),
}


def tiny_teacher(family: str, folder: Path) -> list[str]:
    """Options that distill a tiny random teacher of ``family``, saved into ``folder``."""
    torch.manual_seed(0)
    if family == "digits":
        from dmd2.families.digits.model import build_digits_unet
        build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(folder / "teacher")
        return [f"model.teacher={folder / 'teacher'}"]
    if family not in TINY_PIPELINES:
        raise SystemExit(f"--tiny: no tiny teacher for the {family} family (digits, {', '.join(TINY_PIPELINES)})")
    builder, module, size = TINY_PIPELINES[family]
    teacher = getattr(importlib.import_module(module), builder)(folder / "teacher")
    (folder / "prompts.txt").write_text("\n".join(TINY_PROMPTS) + "\n")
    return [f"model.teacher={teacher}", f"data.prompts={folder / 'prompts.txt'}", *size, *TINY_RUN]


def one_run(recipe: str, seed: int, rollouts: int | None, tiny: bool, options: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        if tiny:
            family = family_for(load_recipe(recipe, parse_overrides(options)).model).name  # as --set names it
            options = tiny_teacher(family, Path(tmp)) + options
        config = load_recipe(recipe, parse_overrides(options))
        config = config.replace("train", seed=seed, rollouts=rollouts or config.train.rollouts)
        family, cache = family_for(config.model), default_cache_dir()
        config = family.resolve(config, cache)
        family = family.bind(family.prepare(config)) if family.prepared_key(config) else family
        distiller = InProcessDistiller.for_family(config, family, cache)
        return measured(GuardedRun(distiller), config, distiller.sample_shape)


def measured(guarded: GuardedRun, config, sample_shape: tuple[int, ...]) -> dict[str, float]:
    times, rows = [], []
    last = [time.perf_counter()]

    def on_rollout(rollout_id, metrics):
        now = time.perf_counter()
        times.append(now - last[0])
        rows.append(metrics)
        last[0] = now

    guarded.run(on_rollout)
    # the signals' cost, measured apart on a batch of the actor's size, and the guard's bookkeeping on the run's rows
    batch = torch.randn(config.critic_batch_size, *sample_shape)
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
    parser.add_argument("--tiny", action="store_true", help="a tiny random teacher of the recipe's family")
    parser.add_argument("--set", dest="options", action="append", default=[], metavar="SECTION.OPTION=VALUE",
                        help="a recipe option, as `dmd2 distill --set` (repeat it)")
    args = parser.parse_args()
    try:  # a bad recipe or option stops here, before any run
        for recipe in args.recipes:
            load_recipe(recipe, parse_overrides(args.options))
    except ConfigError as error:
        parser.error(str(error))
    print("| recipe | seed | rollouts | trips | s / rollout | signals + guard, ms | cost |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for recipe in args.recipes:
        rollouts = args.rollouts or load_recipe(recipe).train.rollouts
        name = " ".join([Path(recipe).name, "(tiny teacher)" if args.tiny else "", *args.options]).strip()
        for seed in args.seeds:
            row = one_run(recipe, seed, args.rollouts, args.tiny, args.options)
            print(f"| {name} | {seed} | {rollouts} | {row['trips']} | {row['rollout_s']:.3f} | "
                  f"{1e3 * (row['signals_s'] + row['observe_s']):.3f} | {row['cost']:.2%} |", flush=True)


if __name__ == "__main__":
    main()

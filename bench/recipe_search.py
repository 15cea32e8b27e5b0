"""Recipe search for the digits students (issue 14): distill named variants in process, score each on the yardstick.

Every variant is a base recipe (4step or 1step) with `--set`-style overrides (parsed by dmd2.config's own
`parse_overrides`, applied by `load_recipe`), optionally with an algorithm patch of this script (a change
to backward simulation tried without editing dmd2/, see PATCHES). The teacher and evaluator are the
cached ones `dmd2 table` uses (dmd2.family.default_cache_dir(), pretrained on first use); the yardstick
(1000 samples, the teacher's 32-step guided reference) is built once. One row per variant is printed as
it finishes (fidelity = FD vs the teacher's 32-step samples, FD vs real, class accuracy, wall seconds of
the distillation), and appended as JSON to --jsonl.

    .venv/bin/python bench/recipe_search.py --list
    .venv/bin/python bench/recipe_search.py --variants base4,lr1e-4 --threads 1
    .venv/bin/python bench/recipe_search.py --custom 'mine|4step|optim.lr=1e-4 dmd2.critic_loss_space=x0'
"""

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPES = {"4step": REPO / "recipes" / "digits-4step.toml", "1step": REPO / "recipes" / "digits-1step.toml"}

# name -> (base recipe, overrides as --set assignments, algorithm patch or None)
VARIANTS: dict[str, tuple[str, list[str], str | None]] = {
    "base4": ("4step", [], None),
    "base1": ("1step", [], None),
    # the actor's and the critic's learning rates
    "lr1e-4": ("4step", ["optim.lr=1e-4"], None),
    "lr2e-4": ("4step", ["optim.lr=2e-4"], None),
    "clr1e-4": ("4step", ["optim.critic_lr=1e-4"], None),
    "clr4e-4": ("4step", ["optim.critic_lr=4e-4"], None),
    # the critic
    "K2": ("4step", ["dmd2.critic_steps_per_rollout=2"], None),
    "K10": ("4step", ["dmd2.critic_steps_per_rollout=10"], None),
    "x0space": ("4step", ["dmd2.critic_loss_space=x0"], None),
    "logitnormal": ("4step", ["dmd2.critic_sigma_sampling=logit_normal"], None),
    "original": ("4step", ["dmd2.critic_scoring=original"], None),
    "ssr-lo": ("4step", ["dmd2.score_sigma_range=[0.02, 0.5]"], None),
    "ssr-hi": ("4step", ["dmd2.score_sigma_range=[0.2, 0.98]"], None),
    # more, smaller rollouts for the same samples (rollouts x batch constant)
    "r500b80": ("4step", ["train.rollouts=500", "train.rollout_batch_size=80"], None),
    "r500b80-lr1e-4": ("4step", ["train.rollouts=500", "train.rollout_batch_size=80", "optim.lr=1e-4"], None),
    # backward simulation: stop steps weighted towards the last step (PATCHES)
    "stoplast": ("4step", [], "stop_linear"),
    "stophalf": ("4step", [], "stop_last_half"),
    "stopgeo": ("4step", [], "stop_geometric"),
    "stopgeo-r220": ("4step", ["train.rollouts=220"], "stop_geometric"),
    # the student's grid: shift < 1 spends more steps at low noise
    "shift0.5": ("4step", ["student.shift=0.5"], None),
    "shift2": ("4step", ["student.shift=2.0"], None),
    "stoplast-lr1e-4": ("4step", ["optim.lr=1e-4"], "stop_linear"),
    # the student's EMA (`[student] ema_decay`) and the GAN head (`[dmd2] gan_weight`, `critic_gan_weight`)
    "ema0.9": ("4step", ["student.ema_decay=0.9"], None),
    "ema0.95": ("4step", ["student.ema_decay=0.95"], None),
    "ema0.99": ("4step", ["student.ema_decay=0.99"], None),
    "gan3e-3": ("4step", ["dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-3"], None),
    "gan3e-2": ("4step", ["dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-2"], None),
    # the 1-step student
    "1step-lr2e-4": ("1step", ["optim.lr=2e-4"], None),
    "1step-clr2e-4": ("1step", ["optim.critic_lr=2e-4"], None),
}


def _weighted_stops(weights: list[float]):
    """A `dmd2.loop.rollout_shard` replacement whose stop index i is drawn with P(i) ∝ weights[i]
    (by inverse CDF of the plan's own per-sample uniform stream "stop"), instead of uniformly."""
    import torch

    import dmd2.rollout as rollout
    from dmd2.draws import shard_rows
    from dmd2.schedule import student_sigmas

    def rollout_shard(student, conds, plan, rank, device="cpu", lockstep=False):
        draws, rows = plan.draws, shard_rows(rank, plan.world_size, plan.critic_steps, plan.batch)
        w = torch.tensor(weights[: plan.num_steps] if len(weights) >= plan.num_steps else [1.0] * plan.num_steps,
                         dtype=torch.float64)
        cdf = (w.cumsum(0) / w.sum())[:-1]
        stop_index = torch.bucketize(draws.uniform("stop", rows).double(), cdf, right=True).to(torch.int64)
        noise = draws.normal("noise", rows, plan.sample_shape, device)
        renoise = [draws.normal(f"renoise/{j}", rows, plan.sample_shape, device) for j in range(plan.num_steps - 1)]
        renoise = torch.stack(renoise) if renoise else noise.new_empty((0, *noise.shape))
        cond, neg_cond = conds(draws, rows)
        sigmas = student_sigmas(plan.num_steps, plan.shift)
        x_i, x0_hat, sigma = rollout.backward_simulate(student, noise, sigmas, stop_index, cond, renoise, lockstep)
        return rollout.RolloutSamples(x_i, x0_hat, sigma, stop_index, cond, neg_cond, rows)

    return rollout_shard


PATCHES = {
    "stop_linear": lambda: _weighted_stops([1.0, 2.0, 3.0, 4.0]),  # P(i) = (i+1)/10 for 4 steps
    "stop_last_half": lambda: _weighted_stops([1.0, 1.0, 1.0, 3.0]),  # half the samples on the last step
    "stop_geometric": lambda: _weighted_stops([1.0, 2.0, 4.0, 8.0]),  # P(i) = 2^i / 15
}


@contextlib.contextmanager
def patched(name: str | None):
    import dmd2.loop as loop

    if name is None:
        yield
        return
    original = loop.rollout_shard
    loop.rollout_shard = PATCHES[name]()
    try:
        yield
    finally:
        loop.rollout_shard = original


def parse_custom(text: str) -> tuple[str, tuple[str, list[str], str | None]]:
    """'name|4step|a.b=1 c.d=x|patch' -> (name, (recipe, overrides, patch))."""
    parts = text.split("|")
    if len(parts) not in (3, 4) or parts[1] not in RECIPES:
        raise SystemExit(f"--custom {text!r}: write NAME|4step or 1step|SECTION.KEY=VALUE ...[|PATCH]")
    patch = parts[3] if len(parts) == 4 and parts[3] else None
    if patch is not None and patch not in PATCHES:
        raise SystemExit(f"--custom {text!r}: unknown patch {patch!r}; patches are {list(PATCHES)}")
    return parts[0], (parts[1], parts[2].split(), patch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="base4,base1", help="comma-separated names of VARIANTS (see --list)")
    parser.add_argument("--custom", action="append", default=[], metavar="NAME|RECIPE|OVERRIDES[|PATCH]",
                        help="an extra variant: overrides are space-separated SECTION.KEY=VALUE (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the built-in variants and exit")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: dmd2.family.default_cache_dir()")
    parser.add_argument("--jsonl", type=Path, default=Path("/tmp/recipe_search.jsonl"),
                        help="append one JSON row per variant here")
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="also save each distilled student here (save_pretrained, one folder per variant)")
    args = parser.parse_args()

    if args.list:
        for name, (recipe, sets, patch) in VARIANTS.items():
            print(f"{name:18s} {recipe}  {' '.join(sets) or '-'}" + (f"  patch={patch}" if patch else ""))
        return 0
    todo = {}
    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; see --list")
        todo[name] = VARIANTS[name]
    todo.update(parse_custom(text) for text in args.custom)

    import torch

    from dmd2.config import load_recipe, parse_overrides
    from dmd2.family import default_cache_dir
    from dmd2.families.digits.data import load_digits_splits
    from dmd2.families.digits.evaluator import DigitsEvaluator
    from dmd2.families.digits.pretrain import resolve_model
    from dmd2.families.digits.table import _distill
    from dmd2.families.digits.yardstick import Yardstick
    from dmd2.model import DiffusersVelocity, load_pretrained

    torch.set_num_threads(args.threads)
    cache_dir = args.cache_dir or default_cache_dir()
    configs = {name: (load_recipe(RECIPES[recipe], parse_overrides(sets)), sets, patch)
               for name, (recipe, sets, patch) in todo.items()}  # every recipe validated before any work

    first = load_recipe(RECIPES["4step"])
    started = time.monotonic()
    splits = load_digits_splits()
    evaluator = DigitsEvaluator.load_or_train(cache_dir, splits)
    teacher = load_pretrained(resolve_model(first.model.teacher, cache_dir)).eval()
    yardstick = Yardstick.build(evaluator, splits, DiffusersVelocity(teacher), num_samples=first.eval.num_samples,
                                reference_steps=first.eval.reference_steps,
                                guidance_scale=first.dmd2.teacher_guidance_scale, seed=first.train.seed)
    print(f"# yardstick built in {time.monotonic() - started:.0f} s; {args.threads} thread(s)", flush=True)
    print("| variant | steps | overrides | fidelity | FD vs real | accuracy | wall s |", flush=True)
    print("|---|---:|---|---:|---:|---:|---:|", flush=True)
    for name, (config, sets, patch) in configs.items():
        if config.dmd2.teacher_guidance_scale != first.dmd2.teacher_guidance_scale:
            raise SystemExit(f"{name}: the yardstick's reference uses guidance {first.dmd2.teacher_guidance_scale}")
        began = time.monotonic()
        with patched(patch):
            student = _distill(config, copy.deepcopy(teacher), cache_dir, name)
        wall = time.monotonic() - began
        if args.save_dir is not None:
            student.save_pretrained(str(args.save_dir / name))
        scores = yardstick.score_model(DiffusersVelocity(student), sampler="student",
                                       num_steps=config.student.num_steps, shift=config.student.grid_shift)
        shown = " ".join(sets) + (f" patch={patch}" if patch else "")
        print(f"| {name} | {config.student.num_steps} | {shown or '-'} | {scores['fd_teacher']:.2f} | "
              f"{scores['fd_real']:.2f} | {scores['accuracy']:.3f} | {wall:.0f} |", flush=True)
        with args.jsonl.open("a") as f:
            f.write(json.dumps({"variant": name, "steps": config.student.num_steps, "overrides": sets, "patch": patch,
                                "threads": args.threads, "wall_s": round(wall, 1), **scores}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

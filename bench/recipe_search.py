"""Recipe search for the digits students (issue 14): distill named variants in process, score each on the yardstick.

Every variant is a base recipe (4step or 1step) with `--set`-style overrides (parsed by dmd2.config's own
`parse_overrides`, applied by `load_recipe`), e.g. `dmd2.stop_weights=[1,2,4,8]` to weight backward
simulation's stop steps. The teacher and evaluator are the cached ones `dmd2 table` uses
(dmd2.family.default_cache_dir(), pretrained on first use); the yardstick (1000 samples, the teacher's 32-step
guided reference) is built once. One row per variant is printed as it finishes (fidelity = FD vs the teacher's
32-step samples in the evaluator's features, pixel KID vs the same samples, FD vs real, class accuracy, wall
seconds of the distillation), and appended as JSON to --jsonl; at the end the variants ranked by both judges
(fidelity and pixel KID), with where they disagree.

    .venv/bin/python bench/recipe_search.py --list
    .venv/bin/python bench/recipe_search.py --variants base4,lr1e-4 --threads 1
    .venv/bin/python bench/recipe_search.py --custom 'mine|4step|optim.lr=1e-4 dmd2.stop_weights=[1,2,4,8]'
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPES = {"4step": REPO / "recipes" / "digits-4step.toml", "1step": REPO / "recipes" / "digits-1step.toml"}

# name -> (base recipe, overrides as --set assignments)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base4": ("4step", []),
    "base1": ("1step", []),
    # the actor's and the critic's learning rates
    "lr1e-4": ("4step", ["optim.lr=1e-4"]),
    "lr2e-4": ("4step", ["optim.lr=2e-4"]),
    "clr1e-4": ("4step", ["optim.critic_lr=1e-4"]),
    "clr4e-4": ("4step", ["optim.critic_lr=4e-4"]),
    # the critic
    "K2": ("4step", ["dmd2.critic_steps_per_rollout=2"]),
    "K10": ("4step", ["dmd2.critic_steps_per_rollout=10"]),
    "x0space": ("4step", ["dmd2.critic_loss_space=x0"]),
    "logitnormal": ("4step", ["dmd2.critic_sigma_sampling=logit_normal"]),
    "original": ("4step", ["dmd2.critic_scoring=original"]),
    "ssr-lo": ("4step", ["dmd2.score_sigma_range=[0.02, 0.5]"]),
    "ssr-hi": ("4step", ["dmd2.score_sigma_range=[0.2, 0.98]"]),
    # more, smaller rollouts for the same samples (rollouts x batch constant)
    "r500b80": ("4step", ["train.rollouts=500", "train.rollout_batch_size=80"]),
    "r500b80-lr1e-4": ("4step", ["train.rollouts=500", "train.rollout_batch_size=80", "optim.lr=1e-4"]),
    # backward simulation: stop steps weighted towards the last step (`[dmd2] stop_weights`)
    "stoplast": ("4step", ["dmd2.stop_weights=[1,2,3,4]"]),
    "stophalf": ("4step", ["dmd2.stop_weights=[1,1,1,3]"]),
    "stopgeo": ("4step", ["dmd2.stop_weights=[1,2,4,8]"]),
    "stopgeo-r220": ("4step", ["dmd2.stop_weights=[1,2,4,8]", "train.rollouts=220"]),
    "stopgeo-seed1": ("4step", ["dmd2.stop_weights=[1,2,4,8]", "train.seed=1"]),
    # the student's grid: shift < 1 spends more steps at low noise
    "shift0.5": ("4step", ["student.shift=0.5"]),
    "shift2": ("4step", ["student.shift=2.0"]),
    "stoplast-lr1e-4": ("4step", ["dmd2.stop_weights=[1,2,3,4]", "optim.lr=1e-4"]),
    # the student's EMA (`[student] ema_decay`) and the GAN head (`[dmd2] gan_weight`, `critic_gan_weight`)
    "ema0.9": ("4step", ["student.ema_decay=0.9"]),
    "ema0.95": ("4step", ["student.ema_decay=0.95"]),
    "ema0.99": ("4step", ["student.ema_decay=0.99"]),
    "gan3e-3": ("4step", ["dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-3"]),
    "gan3e-2": ("4step", ["dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-2"]),
    # combinations with the geometric stop weights, and seeds
    "geo+ema0.9": ("4step", ["dmd2.stop_weights=[1,2,4,8]", "student.ema_decay=0.9"]),
    "geo+gan": ("4step", ["dmd2.stop_weights=[1,2,4,8]", "dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-3"]),
    "base4-seed1": ("4step", ["train.seed=1"]),
    # the 1-step student
    "1step-lr2e-4": ("1step", ["optim.lr=2e-4"]),
    "1step-clr2e-4": ("1step", ["optim.critic_lr=2e-4"]),
}


def parse_custom(text: str) -> tuple[str, tuple[str, list[str]]]:
    """'name|4step|a.b=1 c.d=x' -> (name, (recipe, overrides))."""
    parts = text.split("|")
    if len(parts) != 3 or parts[1] not in RECIPES:
        raise SystemExit(f"--custom {text!r}: write NAME|4step or 1step|SECTION.KEY=VALUE ...")
    return parts[0], (parts[1], parts[2].split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="base4,base1", help="comma-separated names of VARIANTS (see --list)")
    parser.add_argument("--custom", action="append", default=[], metavar="NAME|RECIPE|OVERRIDES",
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
        for name, (recipe, sets) in VARIANTS.items():
            print(f"{name:18s} {recipe}  {' '.join(sets) or '-'}")
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
    from dmd2.families.digits.family import DigitsFamily
    from dmd2.families.digits.pretrain import resolve_model
    from dmd2.families.digits.table import _distill
    from dmd2.families.digits.yardstick import Yardstick
    from dmd2.model import DiffusersVelocity, load_pretrained
    from dmd2.report import rank_by_judges

    torch.set_num_threads(args.threads)
    cache_dir = args.cache_dir or default_cache_dir()
    configs = {name: (load_recipe(RECIPES[recipe], parse_overrides(sets)), sets)
               for name, (recipe, sets) in todo.items()}  # every recipe validated before any work

    first = load_recipe(RECIPES["4step"])
    started = time.monotonic()
    splits = load_digits_splits()
    evaluator = DigitsEvaluator.load_or_train(cache_dir, splits)
    teacher = load_pretrained(resolve_model(first.model.teacher, cache_dir)).eval()
    yardstick = Yardstick.build(evaluator, splits, DiffusersVelocity(teacher), num_samples=first.eval.num_samples,
                                reference_steps=first.eval.reference_steps,
                                guidance_scale=first.dmd2.teacher_guidance_scale, seed=first.train.seed)
    print(f"# yardstick built in {time.monotonic() - started:.0f} s; {args.threads} thread(s)", flush=True)
    print("| variant | steps | overrides | fidelity | pixel KID | FD vs real | accuracy | wall s |", flush=True)
    print("|---|---:|---|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    for name, (config, sets) in configs.items():
        if config.dmd2.teacher_guidance_scale != first.dmd2.teacher_guidance_scale:
            raise SystemExit(f"{name}: the yardstick's reference uses guidance {first.dmd2.teacher_guidance_scale}")
        began = time.monotonic()
        student = _distill(config, copy.deepcopy(teacher), cache_dir, name)
        wall = time.monotonic() - began
        if args.save_dir is not None:
            student.save_pretrained(str(args.save_dir / name))
        scores = yardstick.score_model(DiffusersVelocity(student), sampler="student",
                                       num_steps=config.student.num_steps, shift=config.student.grid_shift)
        shown = " ".join(sets)
        print(f"| {name} | {config.student.num_steps} | {shown or '-'} | {scores['fd_teacher']:.2f} | "
              f"{scores['pixel_kid_teacher']:.4g} | {scores['fd_real']:.2f} | {scores['accuracy']:.3f} | {wall:.0f} |",
              flush=True)
        rows.append((name, {f"eval/{key}": value for key, value in scores.items()}))
        with args.jsonl.open("a") as f:
            f.write(json.dumps({"variant": name, "steps": config.student.num_steps, "overrides": sets,
                                "threads": args.threads, "wall_s": round(wall, 1), **scores}) + "\n")
    if len(rows) > 1:  # ranked by both judges: a variant that wins by one and loses by the other is no winner
        print("\n" + rank_by_judges(rows, DigitsFamily.judges), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The digits family's own commands: `dmd2 pretrain`, `dmd2 sample`, `dmd2 table`."""

import argparse
import os
import sys
from pathlib import Path

from dmd2.family import Command, default_cache_dir

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def _cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                        help=f"where the built-in teacher and evaluator are cached (default {default_cache_dir()}; "
                             "env DMD2_CACHE)")


def _pretrain_args(parser: argparse.ArgumentParser) -> None:
    _cache_arg(parser)


def _pretrain(args: argparse.Namespace) -> int:
    from dmd2.families.digits.pretrain import BUILTIN_DIGITS, resolve_model

    print(f"digits teacher: {resolve_model(BUILTIN_DIGITS, args.cache_dir)}")
    return 0


def _sample_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a diffusers model directory (e.g. a run's student) or builtin:digits")
    parser.add_argument("--steps", type=int, required=True, help="sampling steps")
    parser.add_argument("--sampler", choices=["student", "teacher"], default="student",
                        help="student: few-step x0-predict-and-renoise sampler (default); teacher: Euler ODE")
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale over the null class (default 1: unguided)")
    parser.add_argument("--shift", type=float, default=1.0, help="time shift of the sigma grid (default 1)")
    parser.add_argument("--num-samples", type=int, default=1000, help="how many samples (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    _cache_arg(parser)


def _sample(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from dmd2.families.digits.generation import label_count, sample_labels
    from dmd2.families.digits.pretrain import resolve_model
    from dmd2.files import atomic_file
    from dmd2.model import load_pretrained

    if args.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    model = load_pretrained(resolve_model(args.model, args.cache_dir)).eval()
    try:
        labels = torch.arange(args.num_samples) % label_count(model)
    except ValueError as error:
        raise SystemExit(f"error: --model {args.model}: {error}") from None
    images = sample_labels(model, labels, sampler=args.sampler, num_steps=args.steps, guidance_scale=args.guidance,
                           shift=args.shift, seed=args.seed)
    with atomic_file(args.out) as tmp, open(tmp, "wb") as f:
        np.savez(f, images=images.float().numpy(), labels=labels.numpy().astype(np.int64))
    print(f"wrote {args.num_samples} samples ({args.sampler}, {args.steps} steps, guidance {args.guidance:g}) "
          f"to {args.out}")
    return 0


# The table's student variants: each recipe as it is, and with one of DMD2's optional parts on top.
TABLE_VARIANTS = {
    "recipe": ("", []),
    "ema": (", EMA 0.99", ["student.ema_decay=0.99"]),
    "gan": (", GAN 1e-2 / 3e-3", ["dmd2.critic_gan_weight=1e-2", "dmd2.gan_weight=3e-3"]),
    "lora": (", LoRA rank 8", ["student.lora_rank=8"]),
}


def _table_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", action="append", type=Path,
                        help="a DMD2 recipe to distill (repeatable; default: recipes/digits-4step.toml and "
                             "recipes/digits-1step.toml)")
    parser.add_argument("--variants", default=",".join(TABLE_VARIANTS),
                        help="which students of each recipe get a row, comma-separated: " + ", ".join(
                            f"{name} (recipe{label or ' as it is'})" for name, (label, _) in TABLE_VARIANTS.items())
                        + " (default: all; each 4-step student takes minutes)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe option in every recipe, e.g. --set train.rollouts=50 (repeatable)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    _cache_arg(parser)


def _table(args: argparse.Namespace) -> int:
    import torch

    from dmd2.config import ConfigError, load_recipe, parse_overrides
    from dmd2.families.digits.family import DigitsFamily
    from dmd2.families.digits.table import DISTILL_SECONDS, quality_table, teacher_row_name
    from dmd2.report import format_table, judges_verdict

    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in variants if name not in TABLE_VARIANTS]
    if unknown or not variants:
        raise ConfigError(f"--variants {args.variants!r}: choose from {', '.join(TABLE_VARIANTS)}")
    torch.set_num_threads(args.threads)
    recipes = {}
    for path in args.recipe or [RECIPES / "digits-4step.toml", RECIPES / "digits-1step.toml"]:
        as_is = load_recipe(path, parse_overrides(args.overrides))
        for name in variants:
            label, sets = TABLE_VARIANTS[name]
            config = load_recipe(path, parse_overrides(sets + args.overrides))
            if name != "recipe" and config == as_is:
                print(f"{Path(path).stem}: the {name} variant is the recipe itself (it sets {' '.join(sets)}): "
                      "one row", file=sys.stderr)
                continue
            recipes[f"DMD2 student ({Path(path).stem}{label})"] = config
    columns = DigitsFamily.report_columns | {DISTILL_SECONDS: "wall s"}
    rows = quality_table(recipes, args.cache_dir)
    print(format_table(rows, columns) + "\n")
    teacher_rows = dict(rows)
    for name, config in recipes.items():  # each student against the teacher at its step count, by both judges
        baseline = teacher_row_name(config.student.num_steps, config.dmd2.teacher_guidance_scale)
        print(judges_verdict((name, teacher_rows[name]), (baseline, teacher_rows[baseline]), DigitsFamily.judges))
    return 0


COMMANDS = [
    Command("pretrain", "pretrain and cache the built-in digits teacher",
            "Pretrain the built-in digits teacher (class-conditional flow matching with label dropout) unless it "
            "is cached; print its directory.", _pretrain_args, _pretrain),
    Command("sample", "write generated samples to an .npz",
            "Generate class-balanced samples from a checkpoint and write an .npz with `images` (float32, "
            "N x C x H x W, in [-1, 1]) and `labels` (int64, N).", _sample_args, _sample),
    Command("table", "the in-process digits quality table",
            "Pretrain (or load) the digits teacher, distill one student per recipe in process, and print FD and "
            "class accuracy for every row of the digits yardstick (docs/architecture.md).", _table_args, _table),
]

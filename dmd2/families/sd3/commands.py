"""The sd3 family's own command: `dmd2 text-table`, the text-to-image quality table of one recipe."""

import argparse
import os
from pathlib import Path

from dmd2.family import Command, default_cache_dir


def _table_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", type=Path, required=True,
                        help="an sd3 DMD2 recipe, e.g. recipes/digits-sd3-4step.toml (its teacher, prompts and eval "
                             "settings; one process, one rank)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe option, e.g. --set train.rollouts=50 (repeatable)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                        help=f"where a built-in teacher and judge are cached (default {default_cache_dir()}; "
                             "env DMD2_CACHE)")


def _table(args: argparse.Namespace) -> int:
    import torch

    from dmd2.config import load_recipe, parse_overrides
    from dmd2.family import checked_family
    from dmd2.families.sd3.family import SD3Family
    from dmd2.families.sd3.table import DISTILL_SECONDS, quality_table
    from dmd2.report import format_table, judges_verdict

    config = load_recipe(args.recipe, parse_overrides(args.overrides))
    if checked_family(config) != SD3Family.name:
        from dmd2.config import ConfigError

        raise ConfigError(f"--recipe {args.recipe}: its teacher is not an sd3 pipeline; `dmd2 table` makes the "
                          "digits family's table")
    torch.set_num_threads(args.threads)
    columns = SD3Family.report_columns | {DISTILL_SECONDS: "wall s"}
    rows = quality_table(config, args.cache_dir)
    print(format_table(rows, columns) + "\n")
    student, few_steps = rows[-1], rows[1]  # the distilled student, and the teacher at its step count
    print(judges_verdict(student, few_steps, SD3Family.judges))
    return 0


COMMANDS = [
    Command("text-table", "the in-process text-to-image quality table of an sd3 recipe",
            "Resolve the recipe's teacher (training builtin:digits-sd3 if not cached), distill its student in "
            "process, and print for the teacher at many and few guided steps, the untrained and the distilled "
            "student: the distance to the teacher's many-step samples by two judges (KID in [eval] feature_model's "
            "features and on pixels, each with its standard error), diversity beside the teacher's, and the prompt "
            "accuracy where the judge reads digits (docs/architecture.md). A difference within 2 standard errors "
            "supports no claim either way; to resolve closer rows, sample more noises a prompt, e.g. --set "
            "eval.samples_per_prompt=100.",
            _table_args, _table),
]

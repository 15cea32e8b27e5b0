"""Options shared by the CLI's commands."""

import argparse
import os
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("DMD2_CACHE", Path.home() / ".cache" / "dmd2"))
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where the built-in teacher and evaluator are cached (default {DEFAULT_CACHE}; "
                             "env DMD2_CACHE)")

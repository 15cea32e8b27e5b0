"""The `dmd2` command line. Every command has --help; long work shows progress.

    dmd2 run                            the built-in default end to end (what `make run` runs)
    dmd2 distill --recipe R             distill as Prefect flows on Ray, tracked in MLflow; resumable
    dmd2 evaluate --student DIR         score a student directory on the digits yardstick
    dmd2 serve --name N [--cron C]      serve the distill flow as a deployment (prefect deployment run)
    dmd2 pretrain                       pretrain (and cache) the built-in digits teacher
    dmd2 sample --model M --steps N     write generated samples to an .npz any evaluator can score
    dmd2 table                          the in-process digits quality table (DMD2 core benchmark)
"""

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from flows.cli_common import RECIPES, cache_arg as _cache_arg
from flows.commands import add_distill_args, cmd_distill, cmd_evaluate, cmd_run, cmd_serve


def cmd_pretrain(args: argparse.Namespace) -> int:
    from dmd2.digits.pretrain import BUILTIN_DIGITS, resolve_model
    from flows.progress import ProgressBar

    path = resolve_model(BUILTIN_DIGITS, args.cache_dir, ProgressBar())
    print(f"digits teacher: {path}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from dmd2.digits.pretrain import resolve_model
    from dmd2.model import DiffusersVelocity, load_pretrained
    from dmd2.sample import generate
    from flows.progress import ProgressBar

    model = load_pretrained(resolve_model(args.model, args.cache_dir, ProgressBar())).eval()
    classes = getattr(model.config, "num_class_embeds", None)
    if not classes:
        raise SystemExit(f"error: --model {args.model} is not class-conditional (no num_class_embeds); "
                         "the sample command generates class-conditional models such as the digits teacher")
    labels = torch.arange(args.num_samples) % (classes - 1)  # the last class is the null class
    size = model.config.sample_size
    shape = (model.config.in_channels, *(size if isinstance(size, (list, tuple)) else (size, size)))
    images = generate(DiffusersVelocity(model), {"class_labels": labels},
                      {"class_labels": torch.full_like(labels, classes - 1)}, shape, sampler=args.sampler,
                      num_steps=args.steps, guidance_scale=args.guidance, shift=args.shift, seed=args.seed)
    _save_npz_atomically(args.out, images=images.float().numpy(), labels=labels.numpy().astype(np.int64))
    print(f"wrote {args.num_samples} samples ({args.sampler}, {args.steps} steps, guidance {args.guidance:g}) "
          f"to {args.out}")
    return 0


def _save_npz_atomically(path: Path, **arrays) -> None:
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_table(args: argparse.Namespace) -> int:
    import torch

    from dmd2.config import load_recipe
    from dmd2.digits.table import format_table, quality_table
    from flows.progress import ProgressBar

    torch.set_num_threads(args.threads)
    recipes = {}
    for path in args.recipe:
        config = load_recipe(path)
        recipes[f"DMD2 student ({Path(path).stem})"] = config
    print(format_table(quality_table(recipes, args.cache_dir, ProgressBar())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmd2", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="the built-in default end to end (make run)",
                              description="Pretrain the digits teacher if not cached, distill it with the distill "
                                          "flow (Prefect, local Ray, local store, MLflow on sqlite), print the eval "
                                          "table, and say where the sample grid and the MLflow run are.")
    add_distill_args(run, RECIPES / "digits-4step.toml")
    run.set_defaults(run=cmd_run)

    distill = commands.add_parser("distill", help="distill a recipe with the distill flow",
                                  description="Run the distill flow: one Prefect flow run per rollout on Ray trainer "
                                              "groups, refs in the artifact store, metrics in MLflow. Rerunning "
                                              "with the same --run-id resumes from the last checkpoint.")
    add_distill_args(distill, RECIPES / "digits-4step.toml")
    distill.set_defaults(run=cmd_distill)

    evaluate = commands.add_parser("evaluate", help="score a student directory on the digits yardstick",
                                   description="FD against the held-out digits, FD against the teacher's 32-step "
                                               "guided samples, and class accuracy of a student directory.")
    evaluate.add_argument("--student", type=Path, required=True, help="a run's student directory (save_pretrained)")
    evaluate.add_argument("--recipe", type=Path, default=RECIPES / "digits-4step.toml", help="the run's recipe")
    _cache_arg(evaluate)
    evaluate.set_defaults(run=cmd_evaluate)

    serve = commands.add_parser("serve", help="serve the distill flow as a Prefect deployment",
                                description="Serve the distill flow as deployment 'distill/NAME' (optionally on a "
                                            "cron schedule); start runs with `prefect deployment run 'distill/NAME'`.")
    serve.add_argument("--name", required=True, help="deployment name")
    serve.add_argument("--cron", help="cron schedule for retraining, e.g. '0 3 * * *'")
    serve.add_argument("--recipe", type=Path, default=RECIPES / "digits-4step.toml", help="the recipe to run")
    serve.add_argument("--run-id", help="run id each scheduled run continues (default: the recipe's name)")
    serve.set_defaults(run=cmd_serve)

    pretrain = commands.add_parser("pretrain", help="pretrain and cache the built-in digits teacher",
                                   description="Pretrain the built-in digits teacher (class-conditional flow matching "
                                               "with label dropout) unless it is cached; print its directory.")
    _cache_arg(pretrain)
    pretrain.set_defaults(run=cmd_pretrain)

    sample = commands.add_parser("sample", help="write generated samples to an .npz",
                                 description="Generate class-balanced samples from a checkpoint and write an .npz with "
                                             "`images` (float32, N x C x H x W, in [-1, 1]) and `labels` (int64, N).")
    sample.add_argument("--model", required=True, help="a diffusers model directory (e.g. a run's student) or builtin:digits")
    sample.add_argument("--steps", type=int, required=True, help="sampling steps")
    sample.add_argument("--sampler", choices=["student", "teacher"], default="student",
                        help="student: few-step x0-predict-and-renoise sampler (default); teacher: Euler ODE")
    sample.add_argument("--guidance", type=float, default=1.0, help="CFG scale over the null class (default 1: unguided)")
    sample.add_argument("--shift", type=float, default=1.0, help="time shift of the sigma grid (default 1)")
    sample.add_argument("--num-samples", type=int, default=1000, help="how many samples (default 1000)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    sample.add_argument("--out", type=Path, required=True, help="the .npz to write")
    _cache_arg(sample)
    sample.set_defaults(run=cmd_sample)

    table = commands.add_parser("table", help="the in-process digits quality table",
                                description="Pretrain (or load) the digits teacher, distill one student per recipe in "
                                            "process, and print FD and class accuracy for every row of DESIGN §5.")
    table.add_argument("--recipe", action="append", type=Path,
                       help="a DMD2 recipe to distill (repeatable; default: recipes/digits-4step.toml and "
                            "recipes/digits-1step.toml)")
    table.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    _cache_arg(table)
    table.set_defaults(run=cmd_table)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API request otherwise
    args = build_parser().parse_args(argv)
    if getattr(args, "recipe", "unset") is None:
        args.recipe = [RECIPES / "digits-4step.toml", RECIPES / "digits-1step.toml"]
    if getattr(args, "steps", 1) < 1:
        raise SystemExit("error: --steps must be >= 1")
    from dmd2.config import ConfigError

    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

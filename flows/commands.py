"""The orchestrated commands of the CLI: run (make run), distill, evaluate, serve."""

import argparse
from pathlib import Path

from flows.cli_common import RECIPES, cache_arg

MLFLOW_HINT = "mlflow ui --backend-store-uri {uri}   # then open http://127.0.0.1:5000"


def add_distill_args(parser: argparse.ArgumentParser, default_recipe: Path) -> None:
    parser.add_argument("--recipe", type=Path, default=default_recipe, help=f"TOML recipe (default {default_recipe})")
    parser.add_argument("--rollouts", type=int, help="rollouts to run (default: the recipe's [train] rollouts)")
    parser.add_argument("--run-id", help="run id; rerun with the same id to resume (default: the recipe's name)")
    parser.add_argument("--store", help="artifact store URI: file:///path or s3://bucket/prefix "
                                        "(default $DMD2_STORE or file://./runs)")
    parser.add_argument("--ray-address", help="Ray cluster to join (default $RAY_ADDRESS; unset: a local Ray)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs"),
                        help="where the student directory and sample grid go (default ./runs)")
    cache_arg(parser)


def _distill(args: argparse.Namespace) -> dict:
    from dmd2.config import load_recipe
    from flows.distill import distill
    from infra.store_keys import validate_name

    if args.rollouts is not None and args.rollouts < 1:
        raise SystemExit("error: --rollouts must be >= 1")
    if not args.recipe.is_file():
        raise SystemExit(f"error: --recipe {args.recipe} does not exist (recipes are in {RECIPES})")
    run_id = args.run_id or args.recipe.stem
    try:  # before Prefect and Ray start: a bad id should cost nothing
        validate_name(run_id, "--run-id")
        load_recipe(args.recipe)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return distill(recipe=str(args.recipe), run_id=run_id, rollouts=args.rollouts,
                   store_uri=args.store, ray_address=args.ray_address, tracking_uri=args.tracking_uri,
                   cache_dir=str(args.cache_dir), output_dir=str(args.output_dir))


def _report(result: dict) -> None:
    from infra.tracking import tracking_uri

    scores = result["eval"]
    print(f"\nstudent of run {result['run_id']}: FD vs real {scores['eval/fd_real']:.2f}, "
          f"FD vs teacher 32-step {scores['eval/fd_teacher']:.2f}, class accuracy {scores['eval/accuracy']:.3f}")
    print(f"student (diffusers save_pretrained): {result['student_dir']}")
    print(f"sample grid: {result['grid_path']}")
    print(f"MLflow run {result['mlflow_run_id']}: {MLFLOW_HINT.format(uri=tracking_uri(None))}")


def cmd_distill(args: argparse.Namespace) -> int:
    _report(_distill(args))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The built-in default end to end: the distill flow, then its student beside the teacher's rows."""
    import torch

    from dmd2.config import load_recipe
    from dmd2.digits.table import Row, format_table
    from dmd2.model import DiffusersVelocity
    from flows.distill import resolve_models
    from flows.evaluation import StudentEvaluator
    from infra.models import load_model

    result = _distill(args)
    config = resolve_models(load_recipe(args.recipe), args.cache_dir)
    yardstick = StudentEvaluator.build(config, config.model.teacher, args.cache_dir).yardstick
    teacher = DiffusersVelocity(load_model(config.model.teacher).eval())
    steps, guidance = config.student.num_steps, config.dmd2.teacher_guidance_scale
    with torch.no_grad():
        rows = [Row(f"teacher, {n} steps, guidance {guidance:g}",
                    **yardstick.score_model(teacher, sampler="teacher", num_steps=n, guidance_scale=guidance))
                for n in (config.eval.reference_steps, steps)]
        rows.append(Row(f"untrained student, {steps} steps",
                        **yardstick.score_model(teacher, sampler="student", num_steps=steps)))
    scores = result["eval"]
    rows.append(Row(f"DMD2 student, {steps} steps (this run)", scores["eval/fd_real"], scores["eval/fd_teacher"],
                    scores["eval/accuracy"]))
    print("\n" + format_table(rows))
    _report(result)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score a saved student directory on the digits yardstick."""
    from dmd2.config import load_recipe
    from flows.distill import resolve_models
    from flows.evaluation import StudentEvaluator
    from infra.models import load_model

    config = resolve_models(load_recipe(args.recipe), args.cache_dir)
    evaluator = StudentEvaluator.build(config, config.model.teacher, args.cache_dir)
    scores, _ = evaluator.evaluate(load_model(str(args.student)).eval())
    for key, value in scores.items():
        print(f"{key}: {value:.4f}")
    return 0


def build_deployment(name: str, recipe: Path, run_id: str | None, cron: str | None):
    """The distill flow as deployment `distill/<name>`; every run continues `run_id` (default: the recipe's name)."""
    from flows.distill import distill

    parameters = {"recipe": str(recipe.resolve()), "run_id": run_id or recipe.stem}
    return distill.to_deployment(name=name, cron=cron, parameters=parameters,
                                 description=f"DMD2 distillation of {recipe.name}; rerunning continues the same run")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the distill flow as a deployment: `prefect deployment run 'distill/<name>'` starts runs."""
    from prefect import serve

    if not args.recipe.is_file():
        raise SystemExit(f"error: --recipe {args.recipe} does not exist (recipes are in {RECIPES})")
    serve(build_deployment(args.name, args.recipe, args.run_id, args.cron))
    return 0

"""The orchestrated commands of the CLI: run (make run), distill, evaluate, serve.

Every input is checked first, before Prefect, Ray or MLflow start and before anything heavy is
imported (flows/preflight.py): the recipe, its `--set` overrides, the model family and its model
paths, the run id, the store, that the store and the local outputs are separate folders, and the
Ray, Prefect and MLflow addresses. This module imports nothing heavy at its top for that reason.
"""

import argparse
from pathlib import Path

from dmd2.config import ConfigError
from dmd2.family import default_cache_dir, family_class
from dmd2.report import format_table, judges_verdict
from flows.preflight import preflight, preflight_evaluation
from flows.recipe import DEFAULT_RECIPE, check_rollouts_reach

MLFLOW_HINT = "mlflow ui --backend-store-uri {uri}   # then open http://127.0.0.1:5000"
SET_HELP = ("override a recipe option, typed and validated like the file's, e.g. --set train.rollouts=50 "
            "--set optim.lr=3e-5 (repeatable; every option is in docs/options.md)")


def cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                        help=f"where families cache what they build once, e.g. the built-in digits teacher "
                             f"(default {default_cache_dir()}; env DMD2_CACHE)")


def recipe_args(parser: argparse.ArgumentParser, rollouts: bool = True) -> None:
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help=f"TOML recipe (default {DEFAULT_RECIPE})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=SET_HELP)
    if rollouts:
        parser.add_argument("--rollouts", type=int, help="rollouts to run (default: the recipe's [train] rollouts)")


def add_distill_args(parser: argparse.ArgumentParser) -> None:
    recipe_args(parser)
    parser.add_argument("--run-id", help="run id; rerun with the same id to resume (default: the recipe's name)")
    parser.add_argument("--store", help="artifact store URI: file:///path or s3://bucket/prefix "
                                        "(default $DMD2_STORE or file://./artifacts)")
    parser.add_argument("--ray-address", help="Ray cluster to join (default $RAY_ADDRESS; unset: a local Ray)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"),
                        help="where a copy of the student and the sample pictures go, in <dir>/<run id>/ "
                             "(default ./outputs; must not overlap the store)")
    cache_arg(parser)


def _distill(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """Check everything cheap, then run the distill flow; returns (its result, the family)."""
    checked = preflight(args.recipe, args.overrides, args.rollouts, run_id=args.run_id or args.recipe.stem,
                        store_uri=args.store, output_dir=args.output_dir, cache_dir=args.cache_dir,
                        ray_address=args.ray_address, tracking_uri=args.tracking_uri)
    from infra.store import ArtifactStore, LeaseHeldError, RunLease

    family = family_class(checked.family)()  # the family itself, for its columns and judges
    run_id = checked.run_id
    try:  # before Prefect and Ray are imported: a store that does not open, or a run id in use, costs seconds
        store = ArtifactStore(checked.store_uri)
        RunLease.check_free(store, run_id)
    except (ValueError, LeaseHeldError) as error:
        raise SystemExit(f"error: {error}") from None
    # A run cut back, too (the flow asks again under its lease).
    check_rollouts_reach(run_id, store.latest_checkpoint(run_id), checked.config.train.rollouts)
    from flows.distill import distill
    from flows.prefect_env import start_local_server
    from infra.tracking import uri_to_pass_on

    tracking = uri_to_pass_on(args.tracking_uri, "--tracking-uri")  # a flow parameter: credentials go to the env
    start_local_server()
    result = distill(recipe=str(args.recipe), run_id=run_id, rollouts=args.rollouts, overrides=args.overrides,
                     store_uri=args.store, ray_address=args.ray_address, tracking_uri=tracking,
                     cache_dir=str(args.cache_dir), output_dir=str(args.output_dir))
    return result, family


def _report(result: dict, columns: dict[str, str], tracking_uri: str | None) -> None:
    from infra.tracking import redacted
    from infra.tracking import tracking_uri as resolve_tracking_uri

    scores = ", ".join(f"{heading} {result['eval'][key]:.4g}" for key, heading in columns.items()
                       if key in result["eval"])
    if result["reported"]:
        print(f"\nrun {result['run_id']} had already finished its {result['rollouts']} rollouts: nothing to train "
              "(pass more --rollouts to continue it, or a new --run-id)")
    print(f"\nstudent of run {result['run_id']} after {result['rollouts']} rollouts: {scores}")
    if result["prepared_now"]:
        print("the family's prepared inputs (e.g. encoded prompts) were made by this run; later runs reuse them")
    print(f"student (diffusers save_pretrained): {result['student_dir']}")
    for name, path in result["pictures"].items():
        print(f"{name}: {path}")
    if result.get("model_version"):
        print(f"registered model version {result['model_version']} ({result['promotion']})")
    uri = redacted(resolve_tracking_uri(tracking_uri))
    hint = f"open {uri}" if uri.startswith(("http://", "https://")) else MLFLOW_HINT.format(uri=uri)
    print(f"MLflow run {result['mlflow_run_id']}: {hint}")


def cmd_distill(args: argparse.Namespace) -> int:
    result, family = _distill(args)
    _report(result, family.report_columns, args.tracking_uri)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The built-in default end to end: the distill flow, then its student beside the family's baselines."""
    result, family = _distill(args)
    student = (f"DMD2 student (this run, {result['rollouts']} rollouts)", result["eval"])
    baselines = [tuple(row) for row in result["baselines"] or []]
    print("\n" + format_table([*baselines, student], family.report_columns) + "\n")
    for baseline in baselines:  # a claim over a baseline only where the family's judges agree
        print(judges_verdict(student, baseline, family.judges))
    _report(result, family.report_columns, args.tracking_uri)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score a student directory the way its family evaluates students (in this process)."""
    config, name = preflight_evaluation(args.recipe, args.overrides, args.student)
    import torch

    family = family_class(name)()
    try:  # before the teacher is resolved: a bad --student is refused in seconds, not after a pretraining
        student = family.load_model(str(args.student)).eval()
    except (OSError, ValueError) as error:  # not a model directory of this family (or pickled weights only)
        raise ConfigError(f"--student {args.student} does not load as a {name} model: {error}") from None
    config = family.resolve(config, args.cache_dir)
    with torch.no_grad():
        evaluation = family.evaluator(config, args.cache_dir).evaluate(family.velocity(student))
    for key, value in evaluation.scores.items():
        print(f"{key}: {value:.4f}")
    return 0


def build_deployment(name: str, recipe: Path, run_id: str | None, cron: str | None,
                     overrides: list[str] | None = None, rollouts: int | None = None):
    """The distill flow as deployment `distill/<name>`; every run continues `run_id` (default: the recipe's name).

    One flow run at a time: a run started while one is running waits for it (ENQUEUE).
    """
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.distill import distill

    parameters = {"recipe": str(recipe.resolve()), "run_id": run_id or recipe.stem}
    if overrides:
        parameters["overrides"] = list(overrides)
    if rollouts is not None:
        parameters["rollouts"] = rollouts
    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    return distill.to_deployment(name=name, cron=cron, parameters=parameters, concurrency_limit=one_at_a_time,
                                 description=f"DMD2 distillation of {recipe.name}; rerunning continues the same run")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the distill flow as a deployment: `prefect deployment run 'distill/<name>'` starts runs."""
    # The deployment's runs use this environment's store, Ray and MLflow: refused now, not at the first run.
    preflight(args.recipe, args.overrides, args.rollouts, run_id=args.run_id or args.recipe.stem)
    from prefect import serve

    serve(build_deployment(args.name, args.recipe, args.run_id, args.cron, args.overrides, args.rollouts))
    return 0

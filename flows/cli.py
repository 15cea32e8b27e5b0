"""The `dmd2` command line. Every command has --help; long work shows progress.

    dmd2 run                            the built-in default end to end (what `make run` runs)
    dmd2 distill --recipe R             distill as Prefect flows on Ray, tracked in MLflow; resumable
    dmd2 evaluate --student DIR         score a student directory the way its family evaluates students
    dmd2 serve --name N [--cron C]      serve the distill flow as a deployment (prefect deployment run)
    dmd2 plan --gpu-memory 80GiB        each GPU's memory in every stage of a rollout, before the run
    plus each model family's own commands (digits: pretrain, sample, table; sd3: text-table)

Recipe options can be overridden on the command line: --set SECTION.KEY=VALUE (repeatable), e.g.
    dmd2 distill --recipe recipes/digits-1step.toml --set train.rollouts=50 --set optim.lr=3e-5
"""

import argparse
import logging
import sys
from pathlib import Path

from flows.prefect_env import apply_defaults  # first: before anything imports Prefect

apply_defaults()

from dmd2.config import ConfigError  # noqa: E402
from dmd2.failures import RunError  # noqa: E402
from dmd2.family import all_commands  # noqa: E402
from flows.commands import (add_distill_args, cache_arg, cmd_distill, cmd_evaluate, cmd_run,  # noqa: E402
                            cmd_serve, recipe_args)
from flows.plan import add_plan_args, cmd_plan  # noqa: E402


SET_EPILOG = ("Recipe options are overridden with --set SECTION.KEY=VALUE (repeatable) on run, distill, "
              "evaluate, serve and table; docs/options.md lists them.")


def _orchestrated(commands) -> None:
    run = commands.add_parser("run", help="the built-in default end to end (make run)",
                              description="Pretrain the digits teacher if not cached, distill it with the distill "
                                          "flow (Prefect, local Ray, local store, MLflow on sqlite), print the eval "
                                          "table, and say where the student, the sample grid and the MLflow run are. "
                                          "Run it again: a finished run reports its result without retraining.")
    add_distill_args(run)
    run.set_defaults(run=cmd_run)

    distill = commands.add_parser("distill", help="distill a recipe with the distill flow",
                                  description="Run the distill flow: one Prefect flow run per rollout on Ray trainer "
                                              "groups, refs in the artifact store, metrics in MLflow. Rerunning "
                                              "with the same --run-id resumes from the last checkpoint, or reports "
                                              "the result of a finished run; more --rollouts continue it.")
    add_distill_args(distill)
    distill.set_defaults(run=cmd_distill)

    evaluate = commands.add_parser("evaluate", help="score a student directory",
                                   description="Score a student directory (save_pretrained) with its recipe's model "
                                               "family evaluation, e.g. the digits yardstick: FD against held-out "
                                               "digits, FD against the teacher's samples, class accuracy.")
    evaluate.add_argument("--student", type=Path, required=True, help="a run's student directory (save_pretrained)")
    recipe_args(evaluate, rollouts=False)
    cache_arg(evaluate)
    evaluate.set_defaults(run=cmd_evaluate)

    serve = commands.add_parser("serve", help="serve the distill flow as a Prefect deployment",
                                description="Serve the distill flow as deployment 'distill/NAME' (optionally on a "
                                            "cron schedule); start runs with `prefect deployment run 'distill/NAME'`. "
                                            "--set overrides become the deployment's `overrides` parameter.")
    serve.add_argument("--name", required=True, help="deployment name")
    serve.add_argument("--cron", help="cron schedule for retraining, e.g. '0 3 * * *'")
    recipe_args(serve)
    serve.add_argument("--run-id", help="run id each scheduled run continues (default: the recipe's name)")
    serve.set_defaults(run=cmd_serve)

    plan = commands.add_parser("plan", help="will a recipe fit its GPUs? each GPU's memory in every stage",
                               description="Predict each GPU's peak memory in every stage of a rollout (rollout, "
                                           "convert, critic-train, score, actor-train), split by what holds it, and "
                                           "the host memory the sleeping groups take per node: the ranks' own code "
                                           "rehearses one rollout at the recipe's full model size on fake tensors "
                                           "(no GPU, no weights, no server). Exits 1, naming the stage, the figure "
                                           "and what to change, if the recipe does not fit.")
    add_plan_args(plan)
    plan.set_defaults(run=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmd2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _orchestrated(commands)
    for command in all_commands():
        sub = commands.add_parser(command.name, help=command.help, description=command.description,
                                  epilog=SET_EPILOG)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


class NoTracebackForExplainedErrors(logging.Filter):
    """Prefect logs a failing flow's or task's exception with its traceback. A ConfigError or a RunError names
    what to change, and `main` prints it last: its traceback would only bury that line. (The flow run's log in
    Prefect gets the one line too; a deployment's run, with no CLI in front of it, keeps the traceback.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (ConfigError, RunError)):
            record.exc_info = record.exc_text = None
        return True


_EXPLAINED_ERRORS = NoTracebackForExplainedErrors()  # one instance: addFilter adds it once, however often main runs


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API request otherwise
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(_EXPLAINED_ERRORS)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunError as error:  # a run's own failure (non-finite, the store, lost ranks): its message says it all
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: a line, not the traceback of whichever Ray or Prefect call was waiting
        print("interrupted. A distillation keeps its checkpoints: the same command resumes it from the last one.",
              file=sys.stderr)
        return 130  # what a shell reports for a process that SIGINT ended


if __name__ == "__main__":
    sys.exit(main())

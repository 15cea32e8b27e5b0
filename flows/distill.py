"""The distill flow: validate, build the trainer groups, run rollout flows, checkpoint, evaluate, export.

Run it again with the same run id and it continues from the last complete checkpoint with the same
seeds and the same MLflow run; steps it replays are not logged twice. A run that already reached its
rollouts reports its stored result and trains nothing. The store (artifacts, checkpoints, the
exported student) and the local outputs (a copy of the student, the sample grid) are separate trees.
"""

import dataclasses
import itertools
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from dmd2.config import ConfigError, DistillConfig, config_to_dict
from dmd2.failures import RunError
from dmd2.family import ModelFamily, default_cache_dir, family_class
from dmd2.report import format_table
from dmd2.progress import progress_bar
from flows.outputs import RunResult, artifact_key, find_result, save_result, write_outputs
from flows.collapse import RunGuard
from flows.plan import fit_to_cluster
from flows.preflight import preflight
from flows.recipe import DEFAULT_RECIPE, check_rollouts_reach, check_run_id
from flows.rollout import rollout_flow
from flows.series import series_run_id
from infra.store import ArtifactRef, ArtifactStore, RunLease
from infra.tracking import RunTracker, SystemMetrics, redacted, refuse_user_info, register_student
from infra.trainers import (Groups, RecoverableError, StartedRanks, build_groups, ensure_ray, load_groups,
                            rank_memory, start_ranks)
from tasks import runtime
from tasks.distill import checkpoint, evaluate, export, prepare, reference_media

DEFAULT_OUTPUT_DIR = "outputs"


def train_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """Actor keys as `train/<key>`, critic keys as `train/critic-<key>`; timings keep `time/...`."""
    return {key if "/" in key else f"train/{key}": value for key, value in metrics.items()}


def _due(done: int, interval: int, total: int) -> bool:
    return done == total or (interval > 0 and done % interval == 0)


@flow(name="distill", flow_run_name="distill-{run_id}")
def distill(
    recipe: str = str(DEFAULT_RECIPE),
    run_id: str = "digits-4step",
    rollouts: int | None = None,
    overrides: list[str] | None = None,
    store_uri: str | None = None,
    ray_address: str | None = None,
    tracking_uri: str | None = None,
    cache_dir: str | None = None,
    output_dir: str = DEFAULT_OUTPUT_DIR,
    more_rollouts: int | None = None,
    run_id_template: str | None = None,
) -> dict:
    """Distill the recipe's teacher into its student over `rollouts` rollout flows (default: the recipe's).

    `overrides` are `SECTION.KEY=VALUE` strings, as `--set` takes them. `more_rollouts` continues the run
    by that many rollouts past its last checkpoint instead. `run_id_template` (e.g. "nightly-{date}", for
    scheduled retraining) picks the run id: the series' run with this teacher and these training options,
    or a new one (`flows.series`).

    `store_uri` and `tracking_uri` must carry no credentials (Prefect stores and shows a flow run's
    parameters): they come from the environment (a work pool's job variables for a deployment), e.g.
    AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; the CLI moves the user info
    of an http(s) `--tracking-uri` there itself.
    """
    refuse_user_info(store_uri, "store_uri")  # Prefect holds them already; refused, they reach nothing else
    refuse_user_info(tracking_uri, "tracking_uri")
    if more_rollouts is not None and (rollouts is not None or more_rollouts < 1):
        raise ConfigError(f"more_rollouts = {more_rollouts}: give a number >= 1, and not together with rollouts")
    # Every input, as the CLI checks it: a deployment's run has no CLI in front of it.
    checked = preflight(recipe, overrides, rollouts, run_id=run_id, store_uri=store_uri, output_dir=output_dir,
                        cache_dir=cache_dir, ray_address=ray_address, tracking_uri=tracking_uri)
    config, family = checked.config, family_class(checked.family)()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    store, outputs = ArtifactStore(checked.store_uri), Path(output_dir)
    if run_id_template:  # the series' fingerprint needs the teacher itself
        config = family.resolve(config, cache)
        run_id = series_run_id(store, run_id_template, config)
    check_run_id(run_id)
    # One run per run id: a second run of a held id stops here, in seconds, having changed nothing.
    holder = f"{socket.gethostname()} pid {os.getpid()}, Prefect flow run {flow_run.id}"
    with RunLease.acquire(store, run_id, holder) as lease:
        latest = store.latest_checkpoint(run_id)
        if more_rollouts is not None:
            config = config.replace("train", rollouts=(latest.step if latest else 0) + more_rollouts)
        # Before MLflow: a refusal changes nothing.
        check_rollouts_reach(run_id, latest, config.train.rollouts)
        if not run_id_template:
            config = family.resolve(config, cache)
        if ray_address:
            os.environ["RAY_ADDRESS"] = ray_address
        ranks = prepared = None
        try:
            if find_result(store, run_id, config.train.rollouts) is None:  # a run to train must fit its cluster
                ensure_ray()
                # First what needs a free CPU or GPU of the cluster (a Ray task making the prepared inputs, a GPU
                # asked its memory): the ranks' placement group takes every one they ask for, a small machine's all.
                prepared, memory = prepare(family, config, store), rank_memory(config.cluster)
                # The ranks start up (imports, the model's code) while the plan is made and MLflow set up.
                ranks = start_ranks(config, warm=(family, config.model.student or config.model.teacher))
                # Before any group builds, before MLflow hears of the run:
                config = fit_to_cluster(config, family, cache, memory)
            return _tracked(config, family, run_id, store, outputs, cache, str(recipe), tracking_uri, lease, ranks,
                            prepared)
        finally:
            if ranks is not None:
                ranks.release()  # unless its groups took them


def _tracked(config: DistillConfig, family: ModelFamily, run_id: str, store: ArtifactStore, outputs: Path,
             cache: Path, recipe: str, tracking_uri: str | None, lease: RunLease, ranks: StartedRanks | None,
             prepared: tuple[ArtifactRef | None, bool] | None) -> dict:
    """The run in its MLflow run: trained to its rollouts, or its stored result reported if it has them."""
    tracker = RunTracker.start_or_resume(run_id, uri=tracking_uri)
    status = "FAILED"
    try:
        params = config_to_dict(config)
        target = params["train"].pop("rollouts")  # a later run may extend the same run: a tag, not a param
        tracker.log_params(params)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        tracker.record_flow_run(str(flow_run.id), f"started {started}, to {target} rollouts")
        tracker.set_tags({"dmd2.store": redacted(store.root_uri), "dmd2.recipe": recipe, "dmd2.rollouts": str(target),
                          # which weights the run's evaluations and export are of
                          "dmd2.student_weights": "ema" if config.student.ema_decay > 0 else "raw"})
        result, trained, prepared_now = find_result(store, run_id, target), 0, False
        reported = result is not None
        if reported:
            get_run_logger().info("run %s already has its %d rollouts: reporting its result", run_id, target)
        else:
            result, trained, prepared_now = _run(config, family, run_id, store, tracker, cache, recipe, lease, ranks,
                                                    prepared)
        result = write_outputs(store, result, outputs, tracker, new=not reported)
        registered, promotion = _register(config, family, run_id, result, tracker)
        _lineage_artifact(family, run_id, result, tracker, registered, store.uri(run_id))
        status = "FINISHED"
        return result.to_dict() | {"trained": trained, "reported": reported, "prepared_now": prepared_now,
                                   "model_version": registered, "promotion": promotion}
    finally:
        tracker.finish(status)


def _lineage_artifact(family: ModelFamily, run_id: str, result: RunResult, tracker: RunTracker,
                      registered: str | None, store_prefix: str) -> None:
    """This flow run's Prefect artifact: the eval table and where everything it made lives."""
    rows = [*(result.baselines or []), (f"DMD2 student ({result.rollouts} rollouts)", result.eval)]
    markdown = "\n".join([
        f"# Distill run `{run_id}`", "", format_table(rows, family.report_columns), "",
        f"- MLflow run: `{result.mlflow_run_id}` at `{redacted(tracker.client.tracking_uri)}`",
        f"- registered model version: `{registered or 'not registered ([registry] register = false)'}`",
        f"- store prefix: `{store_prefix}`; exported student: `{result.student.uri}`",
        *(f"- {name}: `{path}`" for name, path in sorted(result.pictures.items()))])
    create_markdown_artifact(markdown, key=artifact_key(f"distill-{run_id}"),
                             description=f"eval table and lineage of distill run {run_id}")


def _register(config: DistillConfig, family: ModelFamily, run_id: str, result: RunResult,
              tracker: RunTracker) -> tuple[str | None, str | None]:
    """The student as a version of the registered model (`champion` moves only if it beats the champion
    on the family's gate metric); returns ("<name>/<version>", why it was or was not promoted), or
    (None, None) with `[registry] register = false`."""
    if not config.registry.register:
        return None, None
    registered = register_student(
        tracker.client, config.registry.model_name or run_id, tracker.mlflow_run_id, Path(result.student_dir),
        family, family.generation_settings(config), result.eval, student_uri=result.student.uri,
        flow_run_id=str(flow_run.id), step=result.rollouts - 1, tags={"dmd2.run_id": run_id})
    get_run_logger().info("registered %s version %s: %s", registered.name, registered.version, registered.reason)
    return f"{registered.name}/{registered.version}", registered.reason


def _run(config: DistillConfig, family: ModelFamily, run_id: str, store: ArtifactStore, tracker: RunTracker,
         cache: Path, recipe: str, lease: RunLease, ranks: StartedRanks | None,
         prepared: tuple[ArtifactRef | None, bool] | None) -> tuple[RunResult, int, bool]:
    """Build the groups (the first on `ranks`, started already), train to the recipe's rollouts, evaluate and
    export; the groups end with it. `prepared`: what `prepare` answered before the ranks started (None: ask now).

    A lost rank (`RecoverableError`: its process died, its collectives broke) costs the rollouts since
    the last checkpoint: new groups load it and the run goes on in this flow run and MLflow run, up to
    `[train] max_failures` times. Returns the result, how many rollouts this flow run advanced the run
    by, and whether it made the prepared inputs."""
    ensure_ray()
    prepared, made = prepared or prepare(family, config, store)
    tracker.set_tags({"dmd2.prepared": prepared.uri if prepared else "none"})
    spec = dataclasses.replace(family.run_spec(config, cache), prepared=prepared)
    threads = max(1, (os.cpu_count() or 1) // config.train.world_size)
    system_metrics = SystemMetrics.of(tracker.client.tracking_uri, tracker.mlflow_run_id)
    first = None  # the first rollout this flow run trained
    for failures in itertools.count():
        groups, lost = None, False
        try:
            groups = build_groups(spec, store, num_threads=threads, system_metrics=system_metrics, started=ranks)
            ranks = None  # taken: new groups after a lost rank start their own
            runtime.register(run_id, groups)
            start = resume(groups, store, run_id)
            first = start if first is None else first
            guard = RunGuard.resume(store, run_id, config, start, family.gate_metric)
            guard.retune(groups)  # a run that rolled back goes on with its rollback's seed and rates
            scores, media, baselines = _train(config, run_id, store, groups, tracker, lease, guard, start)
            lease.check()  # a run that lost its run id exports nothing
            card = {"teacher": config.model.teacher, "recipe": recipe, "run_id": run_id,
                    "rollouts": config.train.rollouts, "scores": scores}
            student = export(run_id, config.train.rollouts, card)
            result = RunResult(run_id, tracker.mlflow_run_id, config.train.rollouts, student, scores, media,
                               baselines)
            save_result(store, result)
            return result, config.train.rollouts - first, made
        except RecoverableError as error:
            lost = True
            _recover_or_raise(config, run_id, store, tracker, error, failures)
        finally:
            runtime.unregister(run_id)
            if groups is not None:
                groups.shutdown(graceful=not lost)
    raise AssertionError("unreachable: the loop returns or raises")


def _recover_or_raise(config: DistillConfig, run_id: str, store: ArtifactStore, tracker: RunTracker,
                      error: RecoverableError, failures: int) -> None:
    """Count a recovery in MLflow and the flow run's log, or fail the run once past `[train] max_failures`."""
    limit = config.train.max_failures
    rollouts, latest = store.list_rollouts(run_id), store.latest_checkpoint(run_id)
    if failures >= limit:
        raise RunError(f"run {run_id} failed: {error}. It recovered {failures} time(s), the limit ([train] "
                       f"max_failures = {limit}); rerun the same command to resume from its last checkpoint "
                       f"({f'after {latest.step} rollouts' if latest else 'none yet'}).") from error
    resumes = f"the checkpoint after {latest.step} rollouts" if latest else "the start (no checkpoint yet)"
    get_run_logger().warning("run %s: %s. Recovering (%d of %d): new trainer groups resume from %s",
                             run_id, error, failures + 1, limit, resumes)
    tracker.log_metrics(rollouts[-1] if rollouts else 0, {"run/recoveries": failures + 1})
    tracker.set_tags({"dmd2.recoveries": str(failures + 1)})


def _train(config: DistillConfig, run_id: str, store: ArtifactStore, groups: Groups, tracker: RunTracker,
           lease: RunLease, guard: RunGuard, start: int):
    """Rollouts from `start` to the target, with checkpoints and evaluations on their intervals, under the
    collapse guard: a rule that trips sends the run back to its last sound checkpoint, or stops it.

    Returns the last evaluation's (scores, media ref, baselines); the baselines are scored once, at the end.
    """
    total, train = config.train.rollouts, config.train
    if start == 0:  # the evaluator's reference pictures (e.g. the teacher's grid), once, at the run's start
        reference = reference_media(run_id)
        for name, picture in (store.get_tensors(reference) if reference else {}).items():
            tracker.log_media(name, picture.numpy(), step=0)
    evaluation = None
    with progress_bar(total, f"distill {run_id}", initial=start, unit="rollout") as bar, rollouts_without_heartbeat():
        rollout_id = start
        while rollout_id < total:
            metrics = rollout_flow(run_id, rollout_id)
            lease.check()  # still this run's id (renewed in the background), before it logs or writes more
            tracker.queue_metrics(rollout_id, train_metric_names(metrics))  # sent every few seconds
            store.prune(run_id, keep_last=train.keep_rollouts)  # the next rollout reads none of them
            done = rollout_id + 1
            trip = guard.observe(rollout_id, metrics, last=done == total)
            if trip is None and _due(done, train.save_interval, total):
                tracker.flush()  # every rollout a checkpoint covers is in MLflow: a resume replays none of them
                guard.checkpointing(done)
                checkpoint(run_id, done)
            if trip is None and _due(done, train.eval_interval, total):  # always after the last rollout
                evaluation = _evaluate(run_id, store, tracker, step=rollout_id, final=done == total)
                trip = guard.judge(done, evaluation.scores)
            if trip is not None:
                rollout_id = guard.recover(trip, groups, tracker)  # or CollapseError: nothing is exported
                bar.n = rollout_id
                continue
            bar.update(1)
            rollout_id = done
    if evaluation is None:  # resumed from the last checkpoint: score the restored student once more
        evaluation = _evaluate(run_id, store, tracker, step=total - 1, final=True)
    return evaluation.scores, evaluation.media, evaluation.baselines


def rollouts_without_heartbeat():
    """Prefect's settings for the rollout flow runs: no heartbeat of their own. They run in this flow run's
    process, whose heartbeat (its thread started with this run, on the settings of then) already tells
    Prefect the process is alive, and a second heartbeat thread per rollout costs up to a second to stop
    (it sleeps in 1 s ticks) at every rollout's end. Entered once for all rollouts: building Prefect's
    settings anew costs ~40 ms."""
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _evaluate(run_id: str, store: ArtifactStore, tracker: RunTracker, step: int, final: bool):
    """Rank 0 evaluates; the driver logs the scores and the media (small pictures or videos) at `step`."""
    evaluation = evaluate(run_id, step, with_baselines=final)
    tracker.log_metrics(step, evaluation.scores)
    if evaluation.media is not None:
        for name, picture in store.get_tensors(evaluation.media).items():
            tracker.log_media(name, picture.numpy(), step=step)
    return evaluation


def resume(groups: Groups, store: ArtifactStore, run_id: str) -> int:
    """Load the last sound checkpoint (if any); return the first rollout still to run.

    A checkpoint that fails its checksums (or misses a file) twice is quarantined, kept under
    `<run_id>/quarantine/`, the user is told, and the one before it is loaded: a run never continues from
    damaged weights, nor stops for them. A store that stays down fails the run and condemns nothing."""
    def damaged(step: int, error: Exception, where: str) -> None:
        get_run_logger().warning("run %s: the checkpoint after %d rollouts is damaged (%s); moved it to %s and "
                                 "resuming from the one before", run_id, step, error, where)

    step = store.resume_checkpoint(run_id, lambda ref: load_groups(groups, ref), on_damaged=damaged)
    if step:
        get_run_logger().info("resuming run %s from its checkpoint after %d rollouts", run_id, step)
    return step

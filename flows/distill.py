"""The distill flow: validate, build the trainer groups, run rollout flows, checkpoint, evaluate, resume.

Run it again with the same run id and it continues from the last complete checkpoint with the same
seeds and the same MLflow run; steps it replays are not logged twice.
"""

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from dmd2.config import ConfigError, DistillConfig, config_to_dict, load_recipe
from dmd2.digits.pretrain import resolve_model
from flows.cli_common import DEFAULT_CACHE
from flows.evaluation import StudentEvaluator
from flows.progress import ProgressBar
from flows.rollout import rollout_flow
from infra.cluster import ensure_ray
from infra.models import class_conditional_task
from infra.rollout_driver import Groups, build_groups, load_groups, save_groups
from infra.store import ArtifactStore
from infra.tracking import RunTracker
from tasks import runtime

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = str(REPO / "recipes" / "digits-4step.toml")


def default_store_uri() -> str:
    return os.environ.get("DMD2_STORE", (Path.cwd() / "runs").as_uri())


@dataclass(frozen=True)
class RunResult:
    run_id: str
    mlflow_run_id: str
    student_dir: str
    eval: dict[str, float]
    grid_path: str


def resolve_models(config: DistillConfig, cache_dir: Path) -> DistillConfig:
    """`builtin:digits` (pretrained and cached on first use) becomes a directory; others stay as given."""
    model = config.model
    return config.replace(
        "model",
        teacher=resolve_model(model.teacher, cache_dir, ProgressBar()),
        student=model.student and resolve_model(model.student, cache_dir),
        critic_load=model.critic_load and resolve_model(model.critic_load, cache_dir),
    )


def train_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """Actor keys as `train/<key>`, critic keys as `train/critic-<key>`; timings keep `time/...`."""
    return {key if "/" in key else f"train/{key}": value for key, value in metrics.items()}


def _due(done: int, interval: int, total: int) -> bool:
    return done == total or (interval > 0 and done % interval == 0)


def resume(groups: Groups, store: ArtifactStore, run_id: str) -> int:
    """Load the last complete checkpoint (if any); return the first rollout still to run."""
    latest = store.latest_checkpoint(run_id)
    if latest is None:
        return 0
    load_groups(groups, latest.ref)
    get_run_logger().info("resuming run %s from its checkpoint after %d rollouts", run_id, latest.step)
    return latest.step


@flow(name="distill", flow_run_name="distill-{run_id}")
def distill(
    recipe: str = DEFAULT_RECIPE,
    run_id: str = "digits-4step",
    rollouts: int | None = None,
    store_uri: str | None = None,
    ray_address: str | None = None,
    tracking_uri: str | None = None,
    cache_dir: str | None = None,
    output_dir: str = "runs",
) -> dict:
    """Distill the recipe's teacher into its student: `rollouts` rollout flows (default: the recipe's)."""
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    config = load_recipe(recipe, overrides={"train": {"rollouts": rollouts}} if rollouts else None)
    if config.train.loss_type != "dmd2":
        raise ConfigError(f"[train] loss_type = {config.train.loss_type!r}: the distill flow runs DMD2 rollouts "
                          "only; set loss_type = 'dmd2'")
    config = resolve_models(config, cache)
    store = ArtifactStore(store_uri or default_store_uri())
    store.checkpoint_key(run_id, 0)  # validates the run id before anything starts
    if ray_address:
        os.environ["RAY_ADDRESS"] = ray_address
    ensure_ray()
    tracker = RunTracker.start_or_resume(run_id, uri=tracking_uri)
    params = config_to_dict(config)
    target = params["train"].pop("rollouts")  # a later run may extend the same run: a tag, not a param
    tracker.log_params(params)
    tracker.set_tags({"prefect.flow_run_id": str(flow_run.id), "dmd2.store": store.root_uri, "dmd2.recipe": recipe,
                      "dmd2.rollouts": str(target)})
    threads = max(1, (os.cpu_count() or 1) // config.train.world_size)
    groups = build_groups(class_conditional_task(config, config.model.teacher), store, num_threads=threads)
    runtime.register(run_id, groups)
    status = "FAILED"
    try:
        result = _train(config, run_id, store, groups, tracker, cache, Path(output_dir))
        status = "FINISHED"
        return result.__dict__
    finally:
        runtime.unregister(run_id)
        groups.shutdown()
        tracker.finish(status)


def _train(config: DistillConfig, run_id: str, store: ArtifactStore, groups: Groups, tracker: RunTracker,
           cache_dir: Path, output_dir: Path) -> RunResult:
    total, train = config.train.rollouts, config.train
    evaluator = StudentEvaluator.build(config, config.model.teacher, cache_dir)
    progress, student, scores, grid = ProgressBar(), None, {}, None
    start = resume(groups, store, run_id)
    if start > total:
        raise ValueError(f"run {run_id} already has {start} rollouts; pass rollouts >= {start} to continue it, "
                         "or use a new run id")
    for rollout_id in range(start, total):
        tracker.log_metrics(rollout_id, train_metric_names(rollout_flow(run_id, rollout_id)))
        store.prune(run_id, keep_last=train.keep_rollouts)  # the next rollout reads none of them
        done = rollout_id + 1
        if _due(done, train.save_interval, total):
            save_groups(groups, run_id, done)
        if _due(done, train.eval_interval, total):  # always after the last rollout
            student = _current_student(run_id, store, groups, evaluator)
            scores, grid = evaluator.evaluate(student)
            tracker.log_metrics(rollout_id, scores)
            tracker.log_image("samples", grid, step=rollout_id)
        progress(f"distill {run_id}", done, total)
    if student is None:  # resumed after the last rollout: score the restored student once more
        student = _current_student(run_id, store, groups, evaluator)
        scores, grid = evaluator.evaluate(student)
    return _export_student(config, run_id, store, student, tracker, output_dir, scores, grid)


def _current_student(run_id: str, store: ArtifactStore, groups: Groups, evaluator: StudentEvaluator):
    """The actor group's current weights, through the store, in a diffusers model on the driver."""
    weights = groups.actor.export_weights(f"{run_id}/eval/student.safetensors")[0]
    return evaluator.load_student(store, weights)


def _export_student(config, run_id, store, student, tracker, output_dir, scores, grid) -> RunResult:
    """The student as a diffusers directory: locally, in the store, and as an MLflow artifact."""
    student_dir = output_dir / run_id / "student"
    student.save_pretrained(student_dir)
    store.put_dir(f"{run_id}/student/{config.train.rollouts}", student_dir)
    tracker.log_artifacts(student_dir, "student")
    grid_path = output_dir / run_id / "samples.png"
    _save_png(grid, grid_path)
    return RunResult(run_id, tracker.mlflow_run_id, str(student_dir), scores, str(grid_path))


def _save_png(pixels, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".png", delete=False) as f:
        Image.fromarray(pixels).save(f, format="PNG")
    os.replace(f.name, path)

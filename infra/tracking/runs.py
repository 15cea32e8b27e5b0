"""MLflow tracking: one MLflow run per distill run, resumable without logging a step twice.

The MLflow run is found again by the tag `dmd2.run_id`, so rerunning a distill run continues the same
MLflow run. Metrics use `step = rollout id`; a (key, step) already in the run is skipped, so rollouts
replayed after a resume from an earlier checkpoint do not duplicate points.
"""

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag

from infra.tracking.credentials import move_credentials_to_environment

log = logging.getLogger(__name__)

RUN_ID_TAG = "dmd2.run_id"
# + a flow run id: one tag per distill flow run (the latest is also in prefect.flow_run_id)
FLOW_RUN_TAG_PREFIX = "prefect.flow_run."
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
MAX_BATCH_METRICS = 1000  # MLflow's limit on the metrics of one log_batch request


def tracking_uri(explicit: str | None = None) -> str:
    """`explicit`, else $MLFLOW_TRACKING_URI, else a sqlite file in the working directory."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def artifacts_beside(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: for a sqlite database, ``mlruns`` beside the database file
    (MLflow's own default is ``./mlruns`` of whatever directory the run starts in, which scatters a team's
    artifacts and leaves them behind in checkouts); for a server, None (the server's artifact root)."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])  # sqlite:////abs/db keeps its leading /
    return (database.absolute().parent / "mlruns").as_uri()


def flatten_params(nested: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"dmd2": {"critic_steps_per_rollout": 5}} -> {"dmd2.critic_steps_per_rollout": "5"}."""
    flat: dict[str, str] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=name + "."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


IMAGE_PREFIX = "image:"


def _logged_images(client: MlflowClient, mlflow_run_id: str) -> set[tuple[str, int]]:
    """(image:key, step) of the images a run holds; MLflow names them `images/<key>+step+<n>+...`."""
    found = set()
    for artifact in client.list_artifacts(mlflow_run_id, "images"):
        parts = Path(artifact.path).name.split("+")
        if len(parts) > 2 and parts[1] == "step" and parts[2].isdigit():
            found.add((IMAGE_PREFIX + parts[0], int(parts[2])))
    return found


class RunTracker:
    """The MLflow run of one distill run."""

    batch_seconds = 5.0  # how long queued metrics may wait before they reach MLflow

    def __init__(self, client: MlflowClient, mlflow_run_id: str, logged: set[tuple[str, int]],
                 previous_status: str | None = None):
        self.client = client
        self.mlflow_run_id = mlflow_run_id
        self._logged = logged
        self._previous_status = previous_status  # of a resumed run: what a failure that added nothing leaves
        self._wrote = False
        self._queued: list[Metric] = []  # `queue_metrics`' points not sent yet
        self._sent_at = time.time()

    @classmethod
    def start_or_resume(cls, run_id: str, experiment: str = "dmd2", uri: str | None = None) -> "RunTracker":
        """Open the MLflow run tagged with `run_id` (creating experiment and run if needed).

        An http(s) tracking URI's user info (e.g. from $MLFLOW_TRACKING_URI) moves into MLflow's credential
        settings first, so the client, the ranks and MLflow's own "View run at" line hold the URI without it.
        """
        client = MlflowClient(move_credentials_to_environment(tracking_uri(uri)))
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=artifacts_beside(client.tracking_uri))
        runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if runs:
            mlflow_run_id, previous = runs[0].info.run_id, runs[0].info.status
            client.update_run(mlflow_run_id, status="RUNNING")
            logged = {(key, m.step) for key in runs[0].data.metrics for m in client.get_metric_history(mlflow_run_id, key)}
            logged |= _logged_images(client, mlflow_run_id)
            log.info("resuming MLflow run %s (%d metric points already logged)", mlflow_run_id, len(logged))
        else:
            mlflow_run_id = client.create_run(experiment_id, tags={RUN_ID_TAG: run_id}, run_name=run_id).info.run_id
            logged, previous = set(), None
        return cls(client, mlflow_run_id, logged, previous)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log the config once; on a resume the same params are already there and are not sent again."""
        existing = self.client.get_run(self.mlflow_run_id).data.params
        fresh = {k: v for k, v in flatten_params(params).items() if k not in existing}
        changed = {k for k, v in flatten_params(params).items() if k in existing and existing[k] != v}
        if changed:
            raise ValueError(f"run was started with other values for {sorted(changed)}; resume with the same "
                             "recipe, or start a new run id")
        if fresh:
            self.client.log_batch(self.mlflow_run_id, params=[Param(k, v) for k, v in fresh.items()])

    def record_flow_run(self, flow_run_id: str, note: str) -> None:
        """Record a Prefect flow run that wrote to this run: one tag each, so none overwrites another."""
        self.set_tags({f"{FLOW_RUN_TAG_PREFIX}{flow_run_id}": note, "prefect.flow_run_id": flow_run_id})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.mlflow_run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log metrics at `step` now (with any queued ones), skipping any (key, step) the run already has."""
        self.queue_metrics(step, metrics)
        self.flush()

    def queue_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log metrics at `step` (stamped now) with the next request: one request per `batch_seconds` at
        most, instead of one per rollout. `log_metrics`, `log_image` and `finish` send the queue first."""
        now = time.time()
        self._queued.extend(Metric(k, float(v), int(now * 1000), step) for k, v in metrics.items()
                            if (k, step) not in self._logged)
        self._logged.update((k, step) for k in metrics)
        if self._queued and (now - self._sent_at >= self.batch_seconds or len(self._queued) >= MAX_BATCH_METRICS):
            self.flush()

    def relog_from(self, step: int) -> None:
        """The rollouts from `step` on run again (the collapse guard rolled the run back): log their new points
        beside the old ones instead of skipping them as a resume's replay."""
        self._logged = {(key, logged) for key, logged in self._logged if logged < step or key.startswith(IMAGE_PREFIX)}

    def flush(self) -> None:
        """Send the queued metrics (MLflow takes up to 1000 in a request); a failed request keeps its batch."""
        while self._queued:
            batch = self._queued[:MAX_BATCH_METRICS]
            self.client.log_batch(self.mlflow_run_id, metrics=batch)
            del self._queued[:len(batch)]
            self._wrote = True
        self._sent_at = time.time()

    def log_image(self, key: str, image: np.ndarray, step: int) -> None:
        """An image (H x W or H x W x C, uint8 or float in [0, 1]) in the run's image gallery at `step`."""
        if (IMAGE_PREFIX + key, step) in self._logged:  # a resume replays steps: keep one image per step
            return
        self.flush()  # the run's metrics reach MLflow before the picture of where they led
        self.client.log_image(self.mlflow_run_id, image, key=key, step=step)
        self._logged.add((IMAGE_PREFIX + key, step))
        self._wrote = True

    def log_media(self, key: str, media: np.ndarray, step: int) -> None:
        """A family's media (dmd2/media.py) at `step`: a picture in the image gallery; a video as an mp4 artifact
        (`videos/<key>/step-<step>.mp4`) with a strip of its frames in the gallery under `key`."""
        from dmd2.media import frame_strip, is_video

        if not is_video(media):
            self.log_image(key, media, step)
            return
        if (IMAGE_PREFIX + key, step) not in self._logged:  # the strip marks the step logged (a resume replays it)
            import tempfile

            from infra.tracking.video import write_mp4

            with tempfile.TemporaryDirectory() as tmp:
                video = write_mp4(media, Path(tmp) / f"step-{step}.mp4")
                self.client.log_artifact(self.mlflow_run_id, str(video), f"videos/{key}")
        self.log_image(key, frame_strip(media), step)

    def has_artifacts(self, artifact_path: str) -> bool:
        return bool(self.client.list_artifacts(self.mlflow_run_id, artifact_path))

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.mlflow_run_id, str(local_dir), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with `status`; a failure that logged nothing leaves a resumed run as it was (a finished
        run stays FINISHED when a rerun is refused, e.g. for a changed recipe)."""
        try:
            self.flush()
        except Exception:
            if status == "FINISHED":
                raise
            log.warning("could not send the run's last metrics to MLflow", exc_info=True)  # keep the run's own error
        if status == "FAILED" and not self._wrote and self._previous_status not in (None, "RUNNING"):
            status = self._previous_status
        self.client.set_terminated(self.mlflow_run_id, status=RunStatus.to_string(RunStatus.from_string(status)))

"""The student in the MLflow model registry: each export one version, the best one aliased `champion`.

`register_student` logs the export as an MLflow model of the distill run (infra/tracking/student_model.py),
registers it as a new version of the named model, tagged with where it came from and its eval figures,
and moves the alias `champion` to it only when its family's gate metric beats the current champion's
(read from that version's tags), by more than the two figures' noise where the evaluation estimated it. A
version whose evaluation was skipped or failed (no figure, or a non-finite one) is never champion. The
version's `dmd2.promotion` tag says why.

The newest version is `models:/<name>/latest`: MLflow resolves that itself (the highest version) and
reserves the alias name `latest`, so no alias is set for it.

Registering is idempotent per export: the version already tagged with the export's store URI is
returned as it is (a retried flow run, or a rerun that reports a finished run's result).
"""

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from dmd2.family import ModelFamily
from dmd2.report import TIE_STANDARD_ERRORS, within_noise
from infra.tracking.credentials import redacted
from infra.tracking.student_model import log_student_model

log = logging.getLogger(__name__)

CHAMPION = "champion"
LATEST_URI = "models:/{name}/latest"  # MLflow's own: the newest version ("latest" is no alias one may set)
PROMOTION_TAG = "dmd2.promotion"  # "champion: ..." or "not promoted: ..."
STUDENT_TAG = "dmd2.student"  # the export's store URI (redacted)
MLFLOW_RUN_TAG, FLOW_RUN_TAG, FAMILY_TAG = "dmd2.mlflow_run_id", "prefect.flow_run_id", "dmd2.family"
MODEL_ID_TAG = "dmd2.logged_model_id"  # the sqlite registry keeps no model id of its own
RUN_VERSION_TAG = "dmd2.model_version"  # on the distill run: "<name>/<version>"


@dataclass(frozen=True)
class RegisteredStudent:
    """A registered version of the student (its LoggedModel `model_id`); `promoted`: it is the champion now;
    `reason`: its promotion tag."""

    name: str
    version: str
    model_id: str
    promoted: bool
    reason: str

    @property
    def model_uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def register_student(client: MlflowClient, model_name: str, mlflow_run_id: str, student_dir: Path,
                     family: ModelFamily, settings: dict[str, Any], scores: Mapping[str, float], *,
                     student_uri: str, flow_run_id: str, step: int = 0,
                     tags: Mapping[str, str] | None = None) -> RegisteredStudent:
    """Log the export in `student_dir` (a local copy of the store's `student_uri`) as a version of `model_name`.

    `mlflow_run_id`: the distill run's (RunTracker.mlflow_run_id), which must exist; `settings`:
    `family.generation_settings(config)`; `scores`: the student's last evaluation (`eval/...`), empty
    when it was skipped; `step`: the rollout the scores were logged at; `tags`: more version tags.
    """
    student_uri = redacted(student_uri)  # a tag: shown in MLflow's UI
    version = _version_of(client, model_name, student_uri)
    if version is None:
        logged = log_student_model(client, mlflow_run_id, student_dir, family, settings, step)
        _ensure_model(client, model_name)
        version_tags = {MLFLOW_RUN_TAG: mlflow_run_id, FLOW_RUN_TAG: flow_run_id, STUDENT_TAG: student_uri,
                        FAMILY_TAG: family.name, MODEL_ID_TAG: logged.model_id,
                        **{key: repr(float(value)) for key, value in scores.items()}, **(tags or {})}
        # The artifacts' location, not `models:/<model_id>`: the sqlite registry resolves that through the
        # process's global tracking URI, which need not be this client's.
        version = client.create_model_version(model_name, source=logged.artifact_location, run_id=mlflow_run_id,
                                              tags=version_tags, model_id=logged.model_id)
        client.set_tag(mlflow_run_id, RUN_VERSION_TAG, f"{model_name}/{version.version}")
    number = str(version.version)  # the sqlite store gives an int
    if PROMOTION_TAG in version.tags:  # registered and decided before
        promoted, reason = _champion(client, model_name) == number, version.tags[PROMOTION_TAG]
    else:
        promoted, reason = _promote(client, model_name, number, version.tags, family)
    return RegisteredStudent(model_name, number, version.tags.get(MODEL_ID_TAG, ""), promoted, reason)


def _promote(client: MlflowClient, name: str, version: str, tags: Mapping[str, str],
             family: ModelFamily) -> tuple[bool, str]:
    """`champion` to `version` (tagged `tags`) if it passes the gate; the decision in its promotion tag."""
    champion, metric = _champion(client, name), family.gate_metric
    current, current_error = None, None
    if champion is not None and champion != version:
        champion_tags = client.get_model_version(name, champion).tags
        current, current_error = (champion, _figure(champion_tags, metric)), _error(champion_tags, metric)
    promoted, reason = promotion(metric, family.gate_lower_is_better, _figure(tags, metric), current,
                                 error=_error(tags, metric), champion_error=current_error)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, PROMOTION_TAG, reason)
    log.info("registered %s version %s: %s", name, version, reason)
    return promoted, reason


def promotion(metric: str | None, lower_is_better: bool, figure: float | None,
              champion: tuple[str, float | None] | None, *, error: float | None = None,
              champion_error: float | None = None) -> tuple[bool, str]:
    """Whether a version with gate `figure` becomes champion over `champion` (its version and figure; None:
    there is none), and why. Only a finite figure is promoted; a tie keeps the champion, and so does a better
    figure within `TIE_STANDARD_ERRORS` standard errors when both figures carry one (`error`, `champion_error`):
    a KID on a small eval set moves that much from noise alone, and the alias must not follow it."""
    if metric is None:
        return False, "not promoted: the family names no gate metric"
    if figure is None:
        return False, f"not promoted: no {metric} (evaluation skipped or failed)"
    if not math.isfinite(figure):
        return False, f"not promoted: {metric} is {figure}"
    if champion is None:
        return True, f"champion: the first version with {metric} ({figure:.4g})"
    version, best = champion
    if best is None or not math.isfinite(best):
        return True, f"champion: {metric} {figure:.4g}; version {version}, the previous champion, had none"
    beats = figure < best if lower_is_better else figure > best
    sign = ("<" if beats else ">=") if lower_is_better else (">" if beats else "<=")
    if beats and error is not None and champion_error is not None and within_noise(figure, error, best,
                                                                                     champion_error):
        return False, (f"not promoted: {metric} {figure:.4g} ± {error:.2g} {sign} {best:.4g} ± {champion_error:.2g} "
                       f"of version {version}, the champion, but within {TIE_STANDARD_ERRORS} standard errors")
    if beats:
        return True, f"champion: {metric} {figure:.4g} {sign} {best:.4g} of version {version}, the previous champion"
    return False, f"not promoted: {metric} {figure:.4g} {sign} {best:.4g} of version {version}, the champion"


def _champion(client: MlflowClient, name: str) -> str | None:
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    return None if version is None else str(version)  # the sqlite store gives an int


def _figure(tags: Mapping[str, str], metric: str | None) -> float | None:
    try:
        return float(tags[metric]) if metric else None
    except (KeyError, ValueError):
        return None


def _error(tags: Mapping[str, str], metric: str | None) -> float | None:
    """The standard error the evaluation gave the gate figure (`<metric>_se`), if a finite one."""
    error = _figure(tags, f"{metric}_se" if metric else None)
    return error if error is not None and math.isfinite(error) else None


def _ensure_model(client: MlflowClient, name: str) -> None:
    try:
        client.create_registered_model(name, description=f"DMD2 students, one version per export; `@{CHAMPION}` "
                                       "is the best by the family's gate metric, `/latest` the newest")
    except MlflowException as error:
        if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _version_of(client: MlflowClient, name: str, student_uri: str) -> ModelVersion | None:
    """The version of `name` registered from the export at `student_uri`, if any."""
    if "'" in student_uri:
        raise ValueError(f"store URI {student_uri!r} has a quote: the registry's search cannot match it")
    found = client.search_model_versions(f"name = '{name}' and tags.`{STUDENT_TAG}` = '{student_uri}'")
    return min(found, key=lambda v: int(v.version)) if found else None

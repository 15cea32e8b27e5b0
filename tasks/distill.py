"""The distill flow's own tasks around the rollouts: prepare, checkpoint, evaluate, export. Thin like the rollout's:
a run id in -> one trainer-group call -> refs and numbers out. The work runs on the actor group's
ranks (rank 0 for evaluation and export), never in the driver.
"""

from prefect import task
from prefect.cache_policies import NO_CACHE

from dmd2.config import DistillConfig
from dmd2.family import ModelFamily
from infra.store import ArtifactRef, ArtifactStore
from infra.trainers import EvalResult, save_groups
from infra.trainers.prepare import prepare_inputs
from tasks.rollout import idempotent
from tasks.runtime import groups


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(run_id: str, step: int) -> ArtifactRef:
    """Every group's checkpoint after `step` rollouts; visible once the actor's, written last, is complete."""
    return save_groups(groups(run_id), run_id, step)


@task(name="evaluate", **idempotent)
def evaluate(run_id: str, step: int, with_baselines: bool = False) -> EvalResult:
    """The family's evaluation of the current student (scores, media in the store, optional baselines)."""
    return groups(run_id).actor.evaluate(run_id, step, with_baselines)


@task(name="export", **idempotent)
def export(run_id: str, step: int, card: dict) -> ArtifactRef:
    """The family's export of the current student, as a directory in the store."""
    return groups(run_id).actor.export(run_id, step, card)


@task(name="prepare", **idempotent)
def prepare(family: ModelFamily, config: DistillConfig, store: ArtifactStore) -> tuple[ArtifactRef | None, bool]:
    """The family's once-per-run inputs (e.g. the encoded prompts), made on a Ray worker unless stored."""
    return prepare_inputs(family, config, store)


@task(name="reference-media", **idempotent)
def reference_media(run_id: str) -> ArtifactRef | None:
    """The evaluator's pictures shown once beside the student's (e.g. the teacher's many-step grid)."""
    return groups(run_id).actor.reference_media(run_id)

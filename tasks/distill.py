"""The distill flow's own tasks, between rollouts: checkpoint, evaluate, export. Thin like the rollout's:
a run id in -> one trainer-group call -> refs and numbers out. The work runs on the actor group's
ranks (rank 0 for evaluation and export), never in the driver.
"""

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.store import ArtifactRef
from infra.trainers import EvalResult, save_groups
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

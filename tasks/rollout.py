"""The six Prefect tasks of a rollout. Each is thin: refs in -> one trainer-group call -> refs out.

Idempotent stages (rollout, convert, score, sleep: functions of the current weights and the rollout's
seeded draws) retry transient faults. The train stages do not: a retry after a half-finished step
could apply an optimizer step twice; the store already retries its own transient I/O.
"""

import time
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.trainers import stages
from infra.store import ArtifactRef
from infra.store.faults import StoreUnavailableError
from tasks.runtime import groups

# A dead rank worker is not among them: Ray does not restart it, so a retry would fail the same way.
TRANSIENT = (StoreUnavailableError, ConnectionError, TimeoutError)


def _transient(task, task_run, state) -> bool:
    """Prefect's retry condition: retry only faults that a moment's wait can cure."""
    try:
        state.result()
    except TRANSIENT:
        return True
    except Exception:
        return False
    return False


# Stages train models: a cached result must never stand in for running one.
idempotent = dict(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=_transient)
stateful = dict(cache_policy=NO_CACHE)


@dataclass(frozen=True)
class StageResult:
    """Per-rank refs (rank i at index i) and a small metrics dict (including the stage's wall time)."""

    refs: list[ArtifactRef]
    metrics: dict[str, float] = field(default_factory=dict)


def merged_metrics(stages: list[StageResult]) -> dict[str, float]:
    """The rollout's metrics from its tasks; a key two tasks report (the actor's two sleeps) is their sum."""
    merged: dict[str, float] = {}
    for stage in stages:
        for key, value in stage.metrics.items():
            merged[key] = merged.get(key, 0.0) + value
    return merged


def _timed(name: str, started: float, metrics: dict[str, float] | None = None) -> dict[str, float]:
    return (metrics or {}) | {f"time/{name}": time.monotonic() - started}


@task(name="rollout", **idempotent)
def rollout(run_id: str, rollout_id: int) -> StageResult:
    """The student's backward-simulated samples (actor group)."""
    started = time.monotonic()
    refs = stages.rollout_stage(groups(run_id), run_id, rollout_id)
    return StageResult(refs, _timed("rollout", started))


@task(name="convert", **idempotent)
def convert(run_id: str, rollout_id: int, samples: StageResult) -> StageResult:
    """One train pair per sample."""
    started = time.monotonic()
    refs = stages.convert_stage(groups(run_id), run_id, rollout_id, samples.refs)
    return StageResult(refs, _timed("convert", started))


@task(name="critic-train", **stateful)
def critic_train(run_id: str, rollout_id: int, pairs: StageResult) -> StageResult:
    """K critic steps; returns what the last step kept for scoring."""
    started = time.monotonic()
    kept, metrics = stages.critic_train_stage(groups(run_id), run_id, rollout_id, pairs.refs)
    return StageResult(kept, _timed("critic-train", started, metrics))


@task(name="score", **idempotent)
def score(run_id: str, rollout_id: int, kept: StageResult, pairs: StageResult) -> StageResult:
    """The frozen teacher's real score at the kept x_s, beside the critic's fake score."""
    started = time.monotonic()
    refs = stages.score_stage(groups(run_id), run_id, rollout_id, kept.refs, pairs.refs)
    return StageResult(refs, _timed("score", started))


@task(name="actor-train", **stateful)
def actor_train(run_id: str, rollout_id: int, pairs: StageResult, scores: StageResult) -> StageResult:
    """One student step with the DMD gradient; rank i reads critic rank i's scores."""
    started = time.monotonic()
    metrics = stages.actor_train_stage(groups(run_id), run_id, rollout_id, pairs.refs, scores.refs)
    return StageResult([], _timed("actor-train", started, metrics))


@task(name="sleep", **idempotent)
def sleep(run_id: str, role: str) -> StageResult:
    """Offload a group after its last use in the rollout, so the peak is the largest group, not the sum."""
    started = time.monotonic()
    run_groups = groups(run_id)
    stages.sleep_stage(run_groups.critic if role == "critic" else run_groups.actor)
    return StageResult([], _timed(f"sleep-{role}", started))

"""The six Prefect tasks of a rollout. Each is thin: refs in -> one trainer-group call -> refs out.

Idempotent stages (rollout, convert, score, sleep: functions of the current weights and the rollout's
seeded draws) retry transient faults. The train stages do not: a retry after a half-finished step
could apply an optimizer step twice; the store's transient I/O is retried by the store alone.

A stage whose input fails its checksum (bytes corrupted at rest) has the task that made the input run
again, then runs itself; every stage reads all its inputs before it changes anything. The critic's
kept scoring inputs are made by a train stage, which cannot run twice: their corruption is a
`RecoverableError`, and the distill flow resumes from the last checkpoint.
"""

import time
from dataclasses import dataclass, field
from typing import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra.trainers import RecoverableError, stages
from infra.store import ArtifactRef, IntegrityError, StoreUnavailableError
from tasks.runtime import groups

# A dead rank worker is not among them: Ray does not restart it, so a retry would fail the same way.
TRANSIENT = (ConnectionError, TimeoutError)
MAX_REMAKES = 2  # per stage: how often a corrupt input is made again before the stage gives up


def _transient(task, task_run, state) -> bool:
    """Prefect's retry condition: retry only faults that a moment's wait can cure.

    Not a store that stayed down: the store has one retry policy, botocore's (`ArtifactStore(retry_mode,
    max_attempts)`), which already waited as long as it should; retrying the task would multiply that wait."""
    try:
        state.result()
    except StoreUnavailableError:
        return False
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
    """Per-rank refs (rank i at index i), a small metrics dict (including the stage's wall time), and
    how to make the refs again: the task that made them and its inputs."""

    refs: list[ArtifactRef]
    metrics: dict[str, float] = field(default_factory=dict)
    made_by: str = ""
    inputs: tuple["StageResult", ...] = ()

    def holds(self, uri: str) -> bool:
        return any(ref.uri == uri for ref in self.refs)


def _from_intact(run: Callable[..., object], run_id: str, rollout_id: int, *inputs: StageResult):
    """`run(*refs of inputs)`; an input that fails its checksum is made again by its task first (a few
    times at most: a store that corrupts every write is not cured by writing again)."""
    for attempt in range(1, MAX_REMAKES + 2):
        try:
            return run(*(i.refs for i in inputs))
        except IntegrityError as error:
            corrupt = next((i for i in inputs if i.holds(error.uri)), None)
            if corrupt is None or attempt > MAX_REMAKES:
                raise
            if corrupt.made_by not in REMAKE:
                raise RecoverableError(f"rollout {rollout_id}: {error}; it was made by {corrupt.made_by}, a "
                                       "training stage that cannot run twice: the run resumes from its last "
                                       "checkpoint") from error
            get_run_logger().warning("rollout %d: %s; %s runs again", rollout_id, error, corrupt.made_by)
            remade = REMAKE[corrupt.made_by](run_id, rollout_id, *corrupt.inputs)
            inputs = tuple(remade if i is corrupt else i for i in inputs)


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
    return StageResult(refs, _timed("rollout", started), "rollout")


@task(name="convert", **idempotent)
def convert(run_id: str, rollout_id: int, samples: StageResult) -> StageResult:
    """One train pair per sample."""
    started = time.monotonic()
    refs = _from_intact(lambda s: stages.convert_stage(groups(run_id), run_id, rollout_id, s),
                        run_id, rollout_id, samples)
    return StageResult(refs, _timed("convert", started), "convert", (samples,))


@task(name="critic-train", **stateful)
def critic_train(run_id: str, rollout_id: int, pairs: StageResult) -> StageResult:
    """K critic steps; returns what the last step kept for scoring."""
    started = time.monotonic()
    kept, metrics = _from_intact(lambda p: stages.critic_train_stage(groups(run_id), run_id, rollout_id, p),
                                 run_id, rollout_id, pairs)
    return StageResult(kept, _timed("critic-train", started, metrics), "critic-train", (pairs,))


@task(name="score", **idempotent)
def score(run_id: str, rollout_id: int, kept: StageResult, pairs: StageResult) -> StageResult:
    """The frozen teacher's real score at the kept x_s, beside the critic's fake score."""
    started = time.monotonic()
    refs = _from_intact(lambda k, p: stages.score_stage(groups(run_id), run_id, rollout_id, k, p),
                        run_id, rollout_id, kept, pairs)
    return StageResult(refs, _timed("score", started), "score", (kept, pairs))


@task(name="actor-train", **stateful)
def actor_train(run_id: str, rollout_id: int, pairs: StageResult, scores: StageResult) -> StageResult:
    """One student step with the DMD gradient; rank i reads critic rank i's scores."""
    started = time.monotonic()
    metrics = _from_intact(lambda p, s: stages.actor_train_stage(groups(run_id), run_id, rollout_id, p, s),
                           run_id, rollout_id, pairs, scores)
    return StageResult([], _timed("actor-train", started, metrics), "actor-train", (pairs, scores))


@task(name="sleep", **idempotent)
def sleep(run_id: str, role: str) -> StageResult:
    """Offload a group after its last use in the rollout, so the peak is the largest group, not the sum."""
    started = time.monotonic()
    run_groups = groups(run_id)
    stages.sleep_stage(run_groups.critic if role == "critic" else run_groups.actor)
    return StageResult([], _timed(f"sleep-{role}", started))


# The tasks that may run again when their output is corrupt: the idempotent ones.
REMAKE = {"rollout": rollout, "convert": convert, "score": score}

"""One DMD2 rollout as a Prefect flow (docs/architecture.md §2): the body is the algorithm's data flow."""

from prefect import flow

from tasks.rollout import actor_train, convert, critic_train, rollout, score, sleep


@flow(name="rollout", flow_run_name="rollout-{rollout_id}")
def rollout_flow(run_id: str, rollout_id: int) -> dict[str, float]:
    """Student samples -> train pairs -> K critic steps -> teacher scores -> one student step.

    Each group sleeps right after its last use: the critic after scoring, the actor after its step.
    Returns the rollout's metrics (actor, critic, and each task's wall time).
    """
    samples = rollout(run_id, rollout_id)
    pairs = convert(run_id, rollout_id, samples)
    kept = critic_train(run_id, rollout_id, pairs)
    scores = score(run_id, rollout_id, kept, pairs)
    critic_asleep = sleep(run_id, "critic")
    actor = actor_train(run_id, rollout_id, pairs, scores)
    actor_asleep = sleep(run_id, "actor")
    stages = (samples, pairs, kept, scores, critic_asleep, actor, actor_asleep)
    return {key: value for stage in stages for key, value in stage.metrics.items()}

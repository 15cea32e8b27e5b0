"""One DMD2 rollout as a Prefect flow (docs/architecture.md §2): the body is the algorithm's data flow."""

from prefect import flow

from tasks.rollout import actor_train, convert, critic_train, merged_metrics, rollout, score, sleep


@flow(name="rollout", flow_run_name="rollout-{rollout_id}")
def rollout_flow(run_id: str, rollout_id: int) -> dict[str, float]:
    """Student samples -> train pairs -> K critic steps -> teacher scores -> one student step.

    A group sleeps whenever the other one needs the accelerator: the actor once its samples are made,
    the critic after scoring, the actor again after its step; so the peak is the larger group's.
    Returns the rollout's metrics (actor, critic, and each task's wall time).
    """
    samples = rollout(run_id, rollout_id)
    actor_made_samples = sleep(run_id, "actor")
    pairs = convert(run_id, rollout_id, samples)
    kept = critic_train(run_id, rollout_id, pairs)
    scores = score(run_id, rollout_id, kept, pairs)
    critic_asleep = sleep(run_id, "critic")
    actor = actor_train(run_id, rollout_id, pairs, scores)
    actor_asleep = sleep(run_id, "actor")
    return merged_metrics([samples, actor_made_samples, pairs, kept, scores, critic_asleep, actor, actor_asleep])

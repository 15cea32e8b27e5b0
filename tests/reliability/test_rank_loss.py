"""A rank SIGKILLed in the middle of critic-train is recovered within the run: new trainer groups load the
last checkpoint, the run finishes in the same Prefect flow run and MLflow run, and its student is the
uninterrupted run's, bit for bit (CPU, same seeds). Past `[train] max_failures` the run fails with the cause."""

import pytest
from mlflow import MlflowClient

from dmd2.failures import RunError
from flows.distill import distill
from tests.flows.conftest import write_recipe
from tests.reliability.checks import assert_every_step_once, assert_same_student
from tests.reliability.faults import kill_one, rank_pids, when
from tests.tracking_db import tracking_uri_in

ROLLOUTS = 3
KILLED_ROLLOUT = 1  # its critic-train: rollout 1 is replayed from the checkpoint after 1 rollout


def _common(tmp_path, teacher, cache, world_size: int = 2, *overrides):
    recipe = write_recipe(tmp_path / "tiny.toml", teacher, ROLLOUTS)
    return dict(recipe=str(recipe), overrides=[f"train.world_size={world_size}", "cluster.cpus_per_rank=0.5", *overrides],
                tracking_uri=tracking_uri_in(tmp_path), cache_dir=str(cache),
                output_dir=str(tmp_path / "out"), store_uri=(tmp_path / "store").as_uri())


def _kill_critic_rank_at(tmp_path, run_id: str, rollout: int):
    """SIGKILL a critic rank once rollout `rollout`'s train pairs exist: the critic's train is what runs next."""
    pairs = tmp_path / "store" / run_id / f"rollout-{rollout}" / "convert"
    return when(lambda: pairs.is_dir() and rank_pids("train"), lambda: kill_one("train"))


@pytest.mark.slow
def test_a_killed_rank_is_recovered_to_the_uninterrupted_student(prefect_server, tiny_teacher_dir, shared_ray,
                                                                 shared_cache, tmp_path):
    common = _common(tmp_path, tiny_teacher_dir, shared_cache)
    killer = _kill_critic_rank_at(tmp_path, "killed", KILLED_ROLLOUT)
    recovered = distill(run_id="killed", **common)
    assert killer.fired and killer.result is not None, "no critic rank was running train to kill"
    uninterrupted = distill(run_id="whole", **common)

    assert_same_student(recovered, uninterrupted)
    assert_every_step_once(common["tracking_uri"], recovered, ROLLOUTS)
    client = MlflowClient(common["tracking_uri"])
    run = client.get_run(recovered["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["dmd2.recoveries"] == "1"
    assert [m.value for m in client.get_metric_history(recovered["mlflow_run_id"], "run/recoveries")] == [1.0]
    # one distill flow run: a single flow-run tag besides prefect.flow_run_id
    assert len([t for t in run.data.tags if t.startswith("prefect.flow_run.")]) == 1


@pytest.mark.slow
def test_past_max_failures_the_run_fails_with_the_cause(prefect_server, tiny_teacher_dir, shared_ray, shared_cache,
                                                       tmp_path):
    # World size 1 keeps it cheap: the killed critic rank is the group's only one.
    common = _common(tmp_path, tiny_teacher_dir, shared_cache, 1, "train.max_failures=0")
    killer = _kill_critic_rank_at(tmp_path, "fragile", 1)
    with pytest.raises(RunError, match=r"critic rank \d died|collective of the critic group broke") as failure:
        distill(run_id="fragile", **common)
    assert killer.fired
    assert "max_failures = 0" in str(failure.value) and "after 1 rollouts" in str(failure.value)
    assert f"pid {killer.result}" in str(failure.value)  # and where that process's log is (see death_note)

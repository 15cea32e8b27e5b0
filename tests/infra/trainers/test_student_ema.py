"""The student's EMA on trainer groups (infra/trainers/rank.py, checkpoint.py), on a real local Ray with real
torch.distributed (gloo). Checked: a resumed run continues the EMA bitwise, and the export is of the EMA's
weights while training keeps the raw ones. World size 1 keeps it cheap: the EMA of FSDP2 shards, saved and
resumed, is tests/infra/trainers/test_sharded.py's (two spawned ranks, no Ray)."""

import pytest
from safetensors.torch import load_file

from infra.trainers.cluster import RankResources
from infra.trainers.stages import build_groups, load_groups, run_rollout_on_groups, save_groups
from tests.infra.trainers.ray_fixtures import new_store, run_spec, tiny_config

RUN = "run"
DECAY = 0.5  # two rollouts move the average visibly away from the raw weights


def ema_task(teacher: str):
    return run_spec(tiny_config(teacher, 1).replace("student", ema_decay=DECAY))


def student_weights(groups, store, tag: str, ema: bool):
    ref = groups.actor.export_weights(f"{RUN}/exports/{tag}-{'ema' if ema else 'raw'}.safetensors", ema=ema)[0]
    return store.get_tensors(ref)


@pytest.fixture(scope="module")
def uninterrupted(shared_ray, tiny_teacher, tmp_path_factory):
    """Two rollouts, checkpointed after the first; then the student's export. The groups stay up for the
    module's tests."""
    tmp = tmp_path_factory.mktemp("ema")
    task, store = ema_task(tiny_teacher), new_store(tmp)
    groups = build_groups(task, store, RankResources(num_cpus=1))
    try:
        run_rollout_on_groups(groups, RUN, 0)
        checkpoint = save_groups(groups, RUN, step=1)
        run_rollout_on_groups(groups, RUN, 1)
        digests = groups.actor.state_digests()
        ema, raw = (student_weights(groups, store, "final", ema) for ema in (True, False))
        exported = store.get_dir(groups.actor.export(RUN, 2, card={}), tmp / "student")
        with pytest.raises(ValueError, match="the critic group keeps no EMA"):
            groups.critic.export_weights(f"{RUN}/exports/critic.safetensors", ema=True)
        yield {"task": task, "store": store, "checkpoint": checkpoint, "digests": digests, "ema": ema, "raw": raw,
               "exported": store_tensors(exported), "after_export": groups.actor.state_digests(), "groups": groups}
    finally:
        groups.shutdown()


def store_tensors(student_dir):
    [weights] = student_dir.glob("*.safetensors")
    return load_file(str(weights))


def assert_equal(found, expected) -> None:
    assert found.keys() == expected.keys()
    assert [name for name in expected if not found[name].equal(expected[name])] == []


def test_a_run_resumed_from_its_checkpoint_continues_the_ema_bitwise(uninterrupted):
    store, groups = uninterrupted["store"], uninterrupted["groups"]  # they trained on past the checkpoint
    load_groups(groups, uninterrupted["checkpoint"])
    run_rollout_on_groups(groups, "resumed", 1)
    assert groups.actor.state_digests() == uninterrupted["digests"]  # weights, optimizer and EMA
    assert_equal(student_weights(groups, store, "resumed", ema=True), uninterrupted["ema"])


def test_the_export_is_the_ema_student_and_training_keeps_its_raw_weights(uninterrupted):
    assert_equal(uninterrupted["exported"], uninterrupted["ema"])
    assert not uninterrupted["ema"]["conv_in.weight"].equal(uninterrupted["raw"]["conv_in.weight"])
    assert uninterrupted["after_export"] == uninterrupted["digests"]  # swapped back bitwise after the export

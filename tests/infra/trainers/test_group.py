"""Trainer groups on a real local Ray (infra/trainers/group.py, rank.py, stages.py).

One Ray for the module; every group is built from the tiny teacher and real torch.distributed (gloo).
"""

import dataclasses
import math
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from diffusers import AutoModel

from dmd2.loop import InProcessDistiller
from flows.plan import resolve_sleep
from infra.trainers.cluster import RankResources, rank_placement_group
from infra.trainers.group import TrainerGroup, TrainResult, death_note
from infra.trainers.hooks import HookError
from infra.trainers.payloads import get_record
from infra.trainers.stages import (Groups, actor_train_stage, build_groups, convert_stage, critic_train_stage,
                                  load_groups, rollout_stage, run_rollout_on_groups, save_groups, score_stage)
from infra.store import ArtifactRef
from infra.trainers.configs import HookPaths, compute_trainer_configs
from tests.reliability.faults import rank_pids
from tests.infra.trainers.ray_fixtures import run_spec, max_abs_diff, new_store, tiny_config
from tests.tracking_db import tracking_uri_in

RUN = "run"
ROLLOUTS = 2


def weights(groups: Groups, store, tag: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each group's parameters, exported by its rank 0 and read back by the test."""
    return {g.role: store.get_tensors(g.export_weights(f"{RUN}/exports/{tag}-{g.role}.safetensors")[0])
            for g in groups.in_order()}


def digests(groups: Groups) -> dict[str, list[str]]:
    return {g.role: g.state_digests() for g in groups.in_order()}


def rollout_without_sleep(groups: Groups, run_id: str, rollout_id: int) -> dict[str, float]:
    """The stages of `run_rollout_on_groups`, called one by one, with no group ever put to sleep."""
    pairs = convert_stage(groups, run_id, rollout_id, rollout_stage(groups, run_id, rollout_id))
    kept, critic_metrics = critic_train_stage(groups, run_id, rollout_id, pairs)
    scores = score_stage(groups, run_id, rollout_id, kept, pairs)
    return actor_train_stage(groups, run_id, rollout_id, pairs, scores) | critic_metrics


@pytest.fixture(scope="module")
def world1(shared_ray, tiny_teacher, tmp_path_factory):
    """Two rollouts at world size 1, then a checkpoint, an evaluation and an export, with the sleep ledger
    read after each and the node's system metrics logged to an MLflow run. The groups stay up for the
    module's later tests (building them is the slow part)."""
    from infra.tracking import RunTracker, SystemMetrics

    tmp = tmp_path_factory.mktemp("world1")
    config = tiny_config(tiny_teacher, 1).replace("eval", num_samples=20, reference_steps=2)
    task, store = run_spec(config), new_store(tmp)
    tracker = RunTracker.start_or_resume("sysmetrics", uri=tracking_uri_in(tmp))
    target = SystemMetrics.of(tracker.client.tracking_uri, tracker.mlflow_run_id, interval_s=0.5)
    groups = build_groups(task, store, system_metrics=target)
    try:
        ledger = {"built": groups.awake_roles()}
        metrics = [run_rollout_on_groups(groups, RUN, r) for r in range(ROLLOUTS)]
        ledger["rollout"] = groups.awake_roles()
        final = weights(groups, store, "final")
        save_groups(groups, RUN, step=ROLLOUTS)
        ledger["checkpoint"] = groups.awake_roles()
        groups.actor.evaluate(RUN, ROLLOUTS - 1)
        ledger["evaluation"] = groups.awake_roles()
        groups.actor.export(RUN, ROLLOUTS, {"scores": {}})
        ledger["export"] = groups.awake_roles()
        groups.actor.wake()
        ledger["woken"] = groups.awake_roles()  # the ledger does see an awake group
        groups.actor.sleep()
        yield {"task": task, "metrics": metrics, "weights": final, "ledger": ledger, "groups": groups,
               "store": store, "tracker": tracker}
    finally:
        groups.shutdown()
        tracker.finish()


@pytest.fixture(scope="module")
def world2(shared_ray, tiny_teacher, tmp_path_factory):
    """Two rollouts at world size 2 (sleeping each group after use), checkpointed after the first. The groups
    stay up for the module's later tests."""
    task = run_spec(tiny_config(tiny_teacher, 2))
    store = new_store(tmp_path_factory.mktemp("world2"))
    groups = build_groups(task, store, RankResources(num_cpus=1))
    try:
        metrics = [run_rollout_on_groups(groups, RUN, 0)]
        after_first = digests(groups)
        checkpoint = save_groups(groups, RUN, step=1)
        metrics.append(run_rollout_on_groups(groups, RUN, 1))
        yield {"task": task, "store": store, "metrics": metrics, "checkpoint": checkpoint, "groups": groups,
               "after_first": after_first, "final": digests(groups), "weights": weights(groups, store, "final")}
    finally:
        groups.shutdown()


def test_world_size_2_makes_the_same_updates_as_world_size_1(world1, world2):
    for role in ("actor", "critic"):
        assert max_abs_diff(world1["weights"][role], world2["weights"][role]) <= 1e-5, role
    for one, two in zip(world1["metrics"], world2["metrics"]):
        assert one.keys() == two.keys()
        for key in ("loss", "critic-loss", "grad_norm", "critic-grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4), key
    # DDP keeps the ranks identical.
    assert all(len(set(ranks)) == 1 for ranks in world2["final"].values())


def test_sleep_auto_on_cpu_ranks_keeps_every_group_resident_and_trains_the_same_student(world1, tiny_teacher,
                                                                                        tmp_path):
    """`[train] sleep = "auto"` for CPU ranks is "never" (flows/plan.py `resolve_sleep`: what sleeps would stay in
    the same memory): no group is ever offloaded, and the weights are world 1's, whose groups slept after every
    stage, bit for bit."""
    config = resolve_sleep(tiny_config(tiny_teacher, 1).replace("train", sleep="auto"), None, "host", 0)
    assert config.train.sleep == "never"
    store = new_store(tmp_path)
    groups = build_groups(run_spec(config), store)
    try:
        ledger = [groups.awake_roles()]
        for rollout in range(ROLLOUTS):
            run_rollout_on_groups(groups, RUN, rollout)
            ledger.append(groups.awake_roles())
        resident = weights(groups, store, "resident")
    finally:
        groups.shutdown()
    assert ledger == [["critic", "actor"]] * (ROLLOUTS + 1)
    for role in ("actor", "critic"):
        assert resident[role].keys() == world1["weights"][role].keys()
        for name, tensor in resident[role].items():
            assert torch.equal(tensor, world1["weights"][role][name]), (role, name)


def test_world_size_1_matches_the_in_process_loop(world1, tiny_teacher):
    task = world1["task"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the same kernels give the same bits
    try:
        distiller = InProcessDistiller.from_models(task.config, AutoModel.from_pretrained(tiny_teacher),
                                                   task.conds, task.sample_shape)
        metrics = []
        distiller.run(range(ROLLOUTS), on_rollout=lambda _, m: metrics.append(m))
    finally:
        torch.set_num_threads(threads)
    assert max_abs_diff(world1["weights"]["actor"], distiller.student.model.state_dict()) <= 1e-5
    assert max_abs_diff(world1["weights"]["critic"], distiller.critic.model.state_dict()) <= 1e-5
    for ray_row, loop_row in zip(world1["metrics"], metrics):
        assert ray_row == pytest.approx(loop_row, rel=1e-5, abs=1e-7)


def test_save_load_continue_equals_uninterrupted_and_sleep_changes_nothing(world2):
    """The groups that went on past the checkpoint load it back and run rollout 1 without ever sleeping: the
    result is bitwise the uninterrupted run, which slept every group after each use."""
    store, groups = world2["store"], world2["groups"]
    assert store.latest_checkpoint(RUN).ref == world2["checkpoint"]
    load_groups(groups, store.latest_checkpoint(RUN).ref)
    assert digests(groups) == world2["after_first"]
    assert groups.awake_roles() == []  # loading does not leave them awake
    for group in groups.in_order():
        group.wake()
        assert all(r["offloaded_bytes"] > 0 for r in group.sleep())
        group.wake()
    assert digests(groups) == world2["after_first"]
    metrics = rollout_without_sleep(groups, "resumed", 1)
    assert digests(groups) == world2["final"]
    assert metrics == world2["metrics"][1]
    for group in groups.in_order():
        group.sleep()


def pairing_group(role: str, task, store, placement) -> TrainerGroup:
    critic, _ = compute_trainer_configs(task.config)
    hooks = HookPaths(loss="tests.infra.trainers.pairing_hooks.tiny_loss", prepare="dmd2.hooks.critic_step_pairs",
                      train_output="tests.infra.trainers.pairing_hooks.rank_output")
    trainer = dataclasses.replace(critic, role=role, teacher=None, steps_per_rollout=1, hooks=hooks)
    return TrainerGroup(trainer, task, store, 2, RankResources(num_cpus=1), placement)


def only_refs(value) -> bool:
    """True when ``value`` holds nothing but refs, numbers and strings (no tensor, no record)."""
    if isinstance(value, (list, tuple)):
        return all(only_refs(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_refs(v) for k, v in value.items())
    if isinstance(value, TrainResult):
        return only_refs([value.output, list(value.metrics)])
    return value is None or isinstance(value, (ArtifactRef, float, int, str))


def test_rank_i_receives_rank_i_of_the_earlier_group_through_the_store(tiny_teacher, tmp_path):
    task = run_spec(tiny_config(tiny_teacher, 2))
    store = new_store(tmp_path)
    placement = rank_placement_group(2, RankResources(num_cpus=1), groups=2)
    groups = Groups(actor=pairing_group("actor", task, store, placement),
                    critic=pairing_group("critic", task, store, placement), placement=placement)
    try:
        pairs = groups.actor.convert(RUN, 0, groups.actor.rollout(RUN, 0))
        first = groups.critic.train(RUN, 0, pairs)
        second = groups.actor.train(RUN, 0, pairs, external_data={"critic": [r.output for r in first]})
        returned = [pairs, first, second]
    finally:
        groups.shutdown()
    assert only_refs(returned)  # the driver held references only
    for rank, (critic_out, actor_out) in enumerate(zip(first, second)):
        assert critic_out.output.uri.endswith(f"{RUN}/rollout-0/critic-train/rank-{rank}.safetensors")
        assert critic_out.metrics[0]["external"] == 0.0 and actor_out.metrics[0]["external"] == 1.0
        made_first, made_second = get_record(store, critic_out.output), get_record(store, actor_out.output)
        assert (made_first.x0_real == rank).all() and (made_first.x0_fake == -1).all()  # the first group got {}
        assert (made_second.x0_real == rank).all() and (made_second.x0_fake == rank).all()  # rank i got rank i's
        assert int(made_second.sigma[0]) not in (0, os.getpid())  # deserialised on the rank, not here


def test_a_hook_path_that_does_not_load_fails_before_any_rank_starts(tiny_teacher):
    task = run_spec(tiny_config(tiny_teacher, 1))
    _, actor = compute_trainer_configs(task.config)
    broken = dataclasses.replace(actor, hooks=dataclasses.replace(actor.hooks, loss="tests.infra.trainers.pairing_hooks.nope"))
    with pytest.raises(HookError, match="hooks.loss = 'tests.infra.trainers.pairing_hooks.nope'"):
        TrainerGroup(broken, task, None, 1)
    with pytest.raises(ValueError, match=r"world size 2 .* \[train\] world_size = 1"):
        TrainerGroup(actor, task, None, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_frees_accelerator_memory_and_wake_brings_it_back(tiny_teacher, tmp_path):
    task = run_spec(tiny_config(tiny_teacher, 1))
    groups = build_groups(task, new_store(tmp_path), RankResources(num_cpus=1, num_gpus=0.5))
    try:
        rollout_without_sleep(groups, RUN, 0)  # the optimizers now hold state
        for group in groups.in_order():
            awake, before = group.device_memory()[0], group.state_digests()
            moved = group.sleep()[0]["offloaded_bytes"]
            asleep = group.device_memory()[0]
            assert asleep <= awake - moved // 2, (group.role, awake, asleep, moved)
            group.wake()
            assert group.device_memory()[0] >= awake - (awake - asleep) // 10
            assert group.state_digests() == before
        run_rollout_on_groups(groups, RUN, 1)  # and it still trains
    finally:
        groups.shutdown()


def test_the_sleep_ledger_shows_no_group_awake_after_each_rollout_checkpoint_and_evaluation(world1):
    assert world1["ledger"] == {"built": [], "rollout": [], "checkpoint": [], "evaluation": [], "export": [],
                                "woken": ["actor"]}


def test_a_bf16_run_completes_on_cpu_and_computes_in_bf16(world1, tiny_teacher, tmp_path):
    config = tiny_config(tiny_teacher, 1).replace("train", mixed_precision="bf16")
    before = set(rank_pids())
    groups = build_groups(run_spec(config), new_store(tmp_path))
    try:
        metrics = run_rollout_on_groups(groups, RUN, 0)
        exported = groups.actor.export_weights(f"{RUN}/exports/bf16.safetensors")[0]
        student = groups.actor.store.get_tensors(exported)
        started = set(rank_pids()) - before
    finally:
        groups.shutdown()
    # The actor's and the critic's rank 0 ran in one process, which ends with the groups (Ray kills it meanwhile).
    deadline = time.monotonic() + 30
    while started & set(rank_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(started) == 1 and not started & set(rank_pids())
    fp32 = world1["metrics"][0]
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["loss"] != fp32["loss"]  # bf16 rounding shows: the compute did run in bf16
    assert abs(metrics["critic-loss"] - fp32["critic-loss"]) < 0.05 * abs(fp32["critic-loss"])
    assert all(t.dtype == torch.float32 for t in student.values())  # the master weights stay fp32


@pytest.fixture(scope="module")
def fsdp_world2(shared_ray, world1, tiny_teacher):
    """Two rollouts at world size 2 with FSDP2 shards (gloo), every group asleep between stages; run "fsdp" in
    world1's store, so that world1's groups can load its checkpoint."""
    task = run_spec(tiny_config(tiny_teacher, 2, parallel="fsdp"))
    store, run = world1["store"], "fsdp"
    groups = build_groups(task, store, RankResources(num_cpus=1))
    try:
        metrics = [run_rollout_on_groups(groups, run, 0)]
        checkpoint = save_groups(groups, run, step=1)
        metrics.append(run_rollout_on_groups(groups, run, 1))
        ledger = groups.awake_roles()
        final = digests(groups)
        offloaded = {group.role: [r["offloaded_bytes"] for r in (group.wake(), group.sleep())[1]]
                     for group in groups.in_order()}
        return {"metrics": metrics, "final": final, "weights": weights(groups, store, "fsdp-final"),
                "ledger": ledger, "offloaded": offloaded, "after_sleeping": digests(groups), "checkpoint": checkpoint}
    finally:
        groups.shutdown()


def test_fsdp_at_world_size_2_trains_the_same_models_as_world_size_1(world1, fsdp_world2):
    for role in ("actor", "critic"):
        assert max_abs_diff(world1["weights"][role], fsdp_world2["weights"][role]) <= 1e-5, role
    for one, two in zip(world1["metrics"], fsdp_world2["metrics"]):
        for key in ("loss", "critic-loss", "grad_norm", "critic-grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4), key
    # Every rank sees the same whole model (its digest is of the gathered state), and all sleep.
    assert all(len(set(ranks)) == 1 for ranks in fsdp_world2["final"].values())
    assert fsdp_world2["ledger"] == []


def test_fsdp_shards_sleep_shard_wise_and_wake_bitwise(tiny_teacher, fsdp_world2):
    parameters = sum(p.numel() for p in AutoModel.from_pretrained(tiny_teacher).parameters())
    for role, per_rank in fsdp_world2["offloaded"].items():
        # Each rank parks its shard: about half the fp32 weights plus AdamW's two moments (3 x 4 bytes / 2).
        assert all(0.4 * 12 * parameters / 2 < moved < 0.6 * 12 * parameters + 4096 for moved in per_rank), role
    assert fsdp_world2["after_sleeping"] == fsdp_world2["final"]


def test_a_sharded_checkpoint_of_world_size_2_continues_at_world_size_1_to_the_same_models(world1, fsdp_world2):
    """FSDP2 shards written by two ranks, loaded into one DDP rank (the world-size-1 groups, which trained on
    meanwhile): rollout 1 then lands where the uninterrupted world-size-1 run did."""
    groups = world1["groups"]
    load_groups(groups, fsdp_world2["checkpoint"])
    run_rollout_on_groups(groups, "continued", 1)
    continued = weights(groups, world1["store"], "continued")
    for role in ("actor", "critic"):
        assert max_abs_diff(world1["weights"][role], continued[role]) <= 1e-5, role


def test_hsdp_at_world_size_4_trains_the_same_models_as_world_size_1(world1, tiny_teacher, tmp_path):
    """A 2 x 2 mesh (gloo): ranks 0-1 and 2-3 each shard one copy and the copies are replicas. Its two rollouts,
    with a checkpoint between them loaded back in place (the replicas' shards written once, each rank reading
    what it holds), land where world size 1 did."""
    task = run_spec(tiny_config(tiny_teacher, 4, parallel="hsdp", shard_group_size=2))
    store = new_store(tmp_path)
    groups = build_groups(task, store, RankResources(num_cpus=0.5))
    try:
        run_rollout_on_groups(groups, RUN, 0)
        load_groups(groups, save_groups(groups, RUN, step=1))
        run_rollout_on_groups(groups, RUN, 1)
        final = weights(groups, store, "hsdp")
    finally:
        groups.shutdown()
    for role in ("actor", "critic"):
        assert max_abs_diff(world1["weights"][role], final[role]) <= 1e-5, role


def test_the_nodes_system_metrics_are_logged_once_under_its_ip_and_ray_node_id(world1):
    tracker = world1["tracker"]
    logged = tracker.client.get_run(tracker.mlflow_run_id).data.metrics
    [node] = ray.nodes()  # both groups' ranks run on it; one monitor samples it all
    label = f"{node['NodeManagerAddress']}-{node['NodeID'][:6]}"
    assert {key.split("/")[1] for key in logged if key.startswith("system/")} == {label}, sorted(logged)
    assert f"system/{label}/cpu_utilization_percentage" in logged
    assert f"system/{label}/system_memory_usage_megabytes" in logged


def test_a_dead_ranks_error_names_its_process_and_its_log(shared_ray):
    """What a user reads when a rank process dies (a native crash, the OOM killer): Ray's reason, the pid,
    and where that process's own log is (with every thread's stack when it crashed in native code)."""

    @ray.remote(num_cpus=0)
    class Doomed:
        def pid(self) -> int:
            return os.getpid()

        def wait(self) -> None:
            time.sleep(60)

    doomed = Doomed.remote()
    pid = ray.get(doomed.pid.remote())
    waiting = doomed.wait.remote()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(waiting, timeout=60)
    note = death_note(died.value)
    assert note.startswith("ActorDiedError: ") and "Worker unexpectedly exits" in note, note
    assert f"pid {pid} on " in note and f"worker-*-{pid}.err in Ray's session logs" in note, note
    assert list(Path("/tmp/ray/session_latest/logs").glob(f"worker-*-{pid}.err")), "the log the note names exists"

"""LoRA trainer groups on a real local Ray (infra/trainers/rank.py with dmd2/lora.py): student and critic
train only their adapters, a checkpoint holds only those and resumes bitwise, the export holds the
merged UNet and the adapter, and FSDP2 shards an adapted model as it does a plain one."""

import json

import pytest
import torch
from diffusers import AutoModel

from infra.store import ArtifactRef
from infra.trainers.cluster import RankResources
from infra.trainers.stages import build_groups, load_groups, run_rollout_on_groups, save_groups
from tests.infra.trainers.ray_fixtures import max_abs_diff, new_store, run_spec, tiny_config

RUN = "run"


def lora_config(teacher: str, world_size: int, **train):
    return tiny_config(teacher, world_size, **train).replace("student", lora_rank=4, lora_alpha=8, critic_lora=True)


def weights(groups, store, tag: str) -> dict[str, dict[str, torch.Tensor]]:
    return {g.role: store.get_tensors(g.export_weights(f"{RUN}/exports/{tag}-{g.role}.safetensors")[0])
            for g in groups.in_order()}


def digests(groups) -> dict[str, list[str]]:
    return {g.role: g.state_digests() for g in groups.in_order()}


@pytest.fixture(scope="module")
def lora_world1(shared_ray, tiny_teacher, tmp_path_factory):
    """Two LoRA rollouts at world size 1, checkpointed after the first, and the student's export. The groups
    stay up for the module's tests (building them is the slow part)."""
    task = run_spec(lora_config(tiny_teacher, 1))
    store = new_store(tmp_path_factory.mktemp("lora"))
    groups = build_groups(task, store)
    try:
        run_rollout_on_groups(groups, RUN, 0)
        after_first = digests(groups)
        checkpoint = save_groups(groups, RUN, step=1)
        run_rollout_on_groups(groups, RUN, 1)
        exported = store.get_dir(groups.actor.export(RUN, 2, {}), tmp_path_factory.mktemp("export") / "student")
        yield {"task": task, "store": store, "checkpoint": checkpoint, "after_first": after_first, "groups": groups,
               "final": digests(groups), "weights": weights(groups, store, "final"), "export": exported}
    finally:
        groups.shutdown()


def test_both_groups_train_only_their_adapters(lora_world1, tiny_teacher):
    teacher = AutoModel.from_pretrained(tiny_teacher).state_dict()
    for role, state in lora_world1["weights"].items():
        base = {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}
        assert base.keys() == teacher.keys(), role
        assert all(torch.equal(v, teacher[k]) for k, v in base.items()), role  # bitwise the teacher's
        assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k), role  # B left zero: trained


def test_a_lora_checkpoint_holds_only_adapters_and_resumes_bitwise(lora_world1, tmp_path):
    store, actor = lora_world1["store"], lora_world1["checkpoint"]
    actor_dir = store.get_dir(actor, tmp_path / "actor")
    critic = ArtifactRef.from_dict(json.loads((actor_dir / "checkpoint.json").read_text())["linked"]["critic"])
    for folder in (actor_dir, store.get_dir(critic, tmp_path / "critic")):
        tensors = json.loads((folder / "dcp_metadata.json").read_text())["tensors"]
        assert tensors and all(".lora_A." in key or ".lora_B." in key for key in tensors), folder.name
    groups = lora_world1["groups"]  # they trained on past the checkpoint: loading takes them back
    load_groups(groups, actor)
    assert digests(groups) == lora_world1["after_first"]
    run_rollout_on_groups(groups, "resumed", 1)
    assert digests(groups) == lora_world1["final"]


def test_the_export_holds_the_merged_unet_and_the_adapter(lora_world1, tiny_teacher):
    from peft import PeftModel

    exported = AutoModel.from_pretrained(str(lora_world1["export"]))
    with_adapter = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_teacher), str(lora_world1["export"] / "lora"))
    generator = torch.Generator().manual_seed(0)
    x, t, labels = torch.randn(2, 1, 8, 8, generator=generator), torch.tensor([800.0, 200.0]), torch.tensor([3, 10])
    with torch.no_grad():
        merged, adapted = exported(x, t, class_labels=labels).sample, with_adapter(x, t, class_labels=labels).sample
        plain = AutoModel.from_pretrained(tiny_teacher)(x, t, class_labels=labels).sample
    assert (merged - adapted).abs().max() < 1e-5
    assert (merged - plain).abs().max() > 0  # trained: not the teacher


def test_fsdp_shards_a_lora_model_and_trains_it_as_world_size_1(lora_world1, tiny_teacher, tmp_path):
    store = new_store(tmp_path)
    groups = build_groups(run_spec(lora_config(tiny_teacher, 2, parallel="fsdp")), store, RankResources(num_cpus=1))
    try:
        for rollout in range(2):
            run_rollout_on_groups(groups, RUN, rollout)
        sharded = weights(groups, store, "fsdp")
        exported = store.get_dir(groups.actor.export(RUN, 2, {}), tmp_path / "student")  # gathered, then merged
    finally:
        groups.shutdown()
    for role in ("actor", "critic"):
        assert max_abs_diff(lora_world1["weights"][role], sharded[role]) <= 1e-5, role
    assert max_abs_diff(AutoModel.from_pretrained(str(exported)).state_dict(),
                        AutoModel.from_pretrained(str(lora_world1["export"])).state_dict()) <= 1e-5

"""dmd2/lora.py on the digits UNet: LoRA options, adapters that start as the teacher, training that moves
only them, the merged model, and the digits export's adapter in peft's format."""

import copy

import pytest
import torch
from diffusers import AutoModel

from dmd2.conditioning import ClassLabels
from dmd2.config import ConfigError, config_from_dict
from dmd2.families.digits.family import LORA_DIR, DigitsFamily
from dmd2.families.digits.model import build_digits_unet
from dmd2.loop import InProcessDistiller
from dmd2.lora import add_adapters, has_adapters, merged_copy, with_role_adapters

TARGETS = DigitsFamily.lora_targets


def tiny_unet(seed: int = 0):
    torch.manual_seed(seed)
    return build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)


def recipe(**student):
    return config_from_dict({
        "model": {"teacher": "tiny"}, "student": {"num_steps": 2, **student},
        "optim": {"lr": 1e-2, "critic_lr": 2e-2}, "dmd2": {"critic_steps_per_rollout": 2, "teacher_guidance_scale": 2.0},
        "train": {"rollout_batch_size": 8, "seed": 3},
    })


def inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 1, 8, 8, generator=generator), torch.tensor([900.0, 500.0, 100.0]), torch.tensor([1, 7, 10])


def out(model):
    x, t, labels = inputs()
    with torch.no_grad():
        return model(x, t, class_labels=labels).sample


def base_state(model) -> dict[str, torch.Tensor]:
    """An adapted model's frozen weights under the names the plain model gives them."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}


def perturbed(model, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # as after training: B is no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model


@pytest.mark.parametrize("student, message", [
    ({"lora_rank": -1}, r"\[student\] lora_rank must be >= 0"),
    ({"lora_rank": 4, "lora_alpha": 0}, r"\[student\] lora_alpha must be > 0"),
    ({"lora_alpha": 8}, r"\[student\] lora_alpha and critic_lora are read only with lora_rank > 0"),
    ({"critic_lora": True}, r"\[student\] lora_alpha and critic_lora are read only with lora_rank > 0"),
])
def test_lora_options_are_validated(student, message):
    with pytest.raises(ConfigError, match=message):
        recipe(**student)


def test_critic_lora_needs_a_critic():
    with pytest.raises(ConfigError, match=r"\[student\] critic_lora is read only under DMD2"):
        config_from_dict({"model": {"teacher": "tiny"}, "student": {"lora_rank": 4, "critic_lora": True},
                          "train": {"loss_type": "flow_matching"}})
    assert recipe(lora_rank=4).student.adapter_alpha == 4 and recipe(lora_rank=4, lora_alpha=2).student.adapter_alpha == 2


def test_the_digits_targets_name_real_layers():
    names = [name for name, _ in tiny_unet().named_modules()]
    for target in TARGETS:
        assert any(name == target or name.endswith("." + target) for name in names), target


def test_adapters_start_as_the_teacher_and_only_they_require_grad():
    teacher = tiny_unet()
    before = torch.get_rng_state()
    student = add_adapters(copy.deepcopy(teacher), 4, 4, TARGETS, seed=9)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left as it was
    assert torch.equal(out(student), out(teacher))  # B = 0
    trained = [name for name, p in student.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert {k: v for k, v in base_state(student).items()}.keys() == teacher.state_dict().keys()
    again = add_adapters(copy.deepcopy(teacher), 4, 4, TARGETS, seed=9)
    other = add_adapters(copy.deepcopy(teacher), 4, 4, TARGETS, seed=10)
    a_weights = [(n, p) for n, p in student.named_parameters() if "lora_A" in n]
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in a_weights)  # the seed alone draws A
    assert not all(torch.equal(p, dict(other.named_parameters())[n]) for n, p in a_weights)
    assert with_role_adapters(teacher, recipe(lora_rank=4), "critic", TARGETS) is teacher  # no critic_lora: as is
    assert not has_adapters(teacher)


@pytest.mark.parametrize("critic_lora", [False, True])
def test_in_process_rollouts_train_only_the_adapters(critic_lora):
    teacher = tiny_unet()
    config = recipe(lora_rank=4, critic_lora=critic_lora)
    distiller = InProcessDistiller.from_models(config, teacher, ClassLabels(10, 10), (1, 8, 8), lora_targets=TARGETS)
    start = {role: copy.deepcopy(getattr(distiller, role).model.state_dict()) for role in ("student", "critic")}
    distiller.run(range(2))
    teacher_state = teacher.state_dict()
    for role in ("student", "critic") if critic_lora else ("student",):
        state = getattr(distiller, role)
        model = state.model
        optimized = {id(p) for group in state.optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for n, p in model.named_parameters() if "lora_" in n}, role
        assert all(torch.equal(v, teacher_state[k]) for k, v in base_state(model).items()), role  # bitwise
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[role][k])]
        assert moved and all("lora_" in k for k in moved), role
        assert any("lora_B" in k for k in moved), role
    if not critic_lora:  # the critic trains all its weights
        critic = distiller.critic.model
        assert not has_adapters(critic)
        assert not all(torch.equal(v, teacher_state[k]) for k, v in critic.state_dict().items())


def test_the_merged_copy_computes_the_adapted_model_and_leaves_it_as_it_was():
    student = perturbed(add_adapters(tiny_unet(), 4, 8, TARGETS, seed=1))
    state = copy.deepcopy(student.state_dict())
    merged = merged_copy(student)
    assert not has_adapters(merged) and merged.state_dict().keys() == tiny_unet().state_dict().keys()
    assert (out(merged) - out(student)).abs().max() < 1e-5
    assert (out(merged) - out(tiny_unet())).abs().max() > 1e-2  # the adapters matter
    assert all(torch.equal(v, state[k]) for k, v in student.state_dict().items())
    # the merged weight of a linear layer is W + (alpha / r) B A, computed here by hand
    layer = student.mid_block.attentions[0].to_q
    by_hand = layer.base_layer.weight + 8 / 4 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged.mid_block.attentions[0].to_q.weight, by_hand, rtol=0, atol=1e-6)


def test_the_digits_export_holds_the_merged_unet_and_its_adapter_in_peft_format(tmp_path):
    from peft import PeftModel

    teacher = tiny_unet()
    student = perturbed(add_adapters(copy.deepcopy(teacher), 4, 8, TARGETS, seed=1))
    config = recipe(lora_rank=4, lora_alpha=8)
    DigitsFamily().export(student, config, tmp_path / "student", {})
    exported = AutoModel.from_pretrained(str(tmp_path / "student"))  # loadable as before: a plain UNet2DModel
    assert type(exported).__name__ == "UNet2DModel" and (out(exported) - out(student)).abs().max() < 1e-5
    assert sorted(p.name for p in (tmp_path / "student" / LORA_DIR).iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    with_adapter = PeftModel.from_pretrained(copy.deepcopy(teacher), str(tmp_path / "student" / LORA_DIR))
    assert (out(with_adapter) - out(exported)).abs().max() < 1e-5
    assert (out(teacher) - out(exported)).abs().max() > 1e-2
    assert "alpha 8" in (tmp_path / "student" / "README.md").read_text()


def test_a_model_on_fake_tensors_gets_the_adapters_a_real_one_gets():
    """`dmd2 plan` rehearses a LoRA student on fake tensors: its adapters have the real model's names, shapes,
    dtypes and trainable flags (peft's own move of adapters to their base layers would fail on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    real = add_adapters(tiny_unet().to(torch.bfloat16), 4, 4.0, TARGETS, seed=0)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)  # a bf16 base, built in place: a fake model cannot be cast
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = add_adapters(tiny_unet(), 4, 4.0, TARGETS, seed=0)
    finally:
        torch.set_default_dtype(default)
    described = [{name: (p.shape, p.dtype, p.requires_grad) for name, p in model.named_parameters()}
                 for model in (real, fake)]
    assert described[0] == described[1] and any("lora_A" in name for name in described[0])
    assert all(is_fake(p) for p in fake.parameters())

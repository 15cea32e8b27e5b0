"""The EMA of the student (dmd2/ema.py), the trainer that updates it (dmd2/trainer.py), the in-process
loop and the digits table that use it."""

import copy

import pytest
import torch

from dmd2.config import DistillConfig, DMD2Config, ModelConfig, OptimConfig, StudentConfig, TrainConfig
from dmd2.ema import ParameterEMA
from dmd2.families.digits.data import IMAGE_SHAPE
from dmd2.families.digits.table import _distill
from dmd2.families.digits.yardstick import DIGIT_CONDS
from dmd2.loop import InProcessDistiller
from dmd2.trainer import Hooks, train_state, train_steps
from tests.dmd2.conftest import TinyVelocity
from tests.dmd2.test_loop import tiny_teacher

DECAY = 0.6  # far from 1, so that a few steps move the average visibly away from both ends


def config(ema_decay: float, rollouts: int = 3) -> DistillConfig:
    return DistillConfig(model=ModelConfig(teacher="tiny"), student=StudentConfig(num_steps=2, ema_decay=ema_decay),
                         optim=OptimConfig(lr=1e-2, critic_lr=2e-3), dmd2=DMD2Config(teacher_guidance_scale=2.0),
                         train=TrainConfig(rollouts=rollouts, rollout_batch_size=10, seed=3))


def explicit_ema(trajectory: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """ema_0 = the first weights; ema_k = decay ema_{k-1} + (1 - decay) w_k, in float64, name by name."""
    ema = {name: value.double() for name, value in trajectory[0].items()}
    for weights in trajectory[1:]:
        for name, average in ema.items():
            ema[name] = decay * average + (1 - decay) * weights[name].double()
    return ema


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_close(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name].double(), value, rtol=0, atol=1e-6, msg=name)


def test_the_ema_follows_an_explicit_loop_over_the_optimizer_steps_and_skips_frozen_parameters():
    model = TinyVelocity()
    model.embed.requires_grad_(False)
    state = train_state(model, 1e-2, config(DECAY), velocity=lambda m: m, ema_decay=DECAY)
    trajectory = []  # the weights before each step (prepare runs before it), then the last ones
    labels = torch.arange(4) % 3

    def prepare(ctx, batches, step):
        trajectory.append(trainable(model))
        return batches[step]

    def loss(ctx, velocity, x, step):
        return velocity(x, torch.full((4,), 0.5), {"class_labels": labels}).square().mean(), {}, None

    batches = torch.randn(3, 4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    for num_steps in (2, 1, 3):  # several calls, several steps per call
        train_steps(state, Hooks(loss=loss, prepare=prepare), None, batches, num_steps)
    trajectory.append(trainable(model))
    assert len(trajectory) == 7
    assert set(state.ema.state_dict()) == {"conv.weight", "conv.bias", "sigma_scale"}  # not the frozen embedding
    assert_close(state.ema.state_dict(), explicit_ema(trajectory, DECAY))
    assert not torch.allclose(state.ema.state_dict()["conv.weight"], model.conv.weight)  # it did lag behind


def test_applied_holds_the_average_inside_and_gives_the_raw_weights_back_bitwise():
    model = TinyVelocity()
    ema = ParameterEMA(model, DECAY)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    ema.update()
    raw, average = copy.deepcopy(model.state_dict()), copy.deepcopy(ema.state_dict())
    weight = model.conv.weight
    with pytest.raises(RuntimeError, match="inside"), ema.applied():
        for name, value in average.items():
            assert torch.equal(model.state_dict()[name], value), name
        assert model.conv.weight is weight  # swapped in place: the optimizer's references hold
        raise RuntimeError("inside")
    for name, value in raw.items():
        assert torch.equal(model.state_dict()[name], value), name
    for name, value in average.items():
        assert torch.equal(ema.state_dict()[name], value), name
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ParameterEMA(model, 1.0)


def test_the_in_process_loop_averages_the_student_after_each_actor_step_and_the_critic_keeps_none(tmp_path):
    cfg = config(DECAY)
    distiller = InProcessDistiller.from_models(cfg, tiny_teacher(tmp_path), DIGIT_CONDS, IMAGE_SHAPE)
    trajectory = [trainable(distiller.student.model)]
    distiller.run(range(cfg.train.rollouts), lambda r, m: trajectory.append(trainable(distiller.student.model)))
    assert distiller.critic.ema is None
    assert_close(distiller.student.ema.state_dict(), explicit_ema(trajectory, DECAY))


def test_the_digits_table_scores_the_ema_student_when_the_recipe_keeps_one(tmp_path):
    cfg = config(DECAY, rollouts=2)
    teacher = tiny_teacher(tmp_path)
    replay = InProcessDistiller.from_models(cfg, copy.deepcopy(teacher), DIGIT_CONDS, IMAGE_SHAPE)
    replay.run(range(cfg.train.rollouts))
    student = _distill(cfg, copy.deepcopy(teacher), tmp_path, "ema").state_dict()
    for name, average in replay.student.ema.state_dict().items():
        assert torch.equal(student[name], average), name
    assert not torch.equal(student["conv_in.weight"], replay.student.model.state_dict()["conv_in.weight"])
    raw = _distill(config(0.0, rollouts=2), copy.deepcopy(teacher), tmp_path, "raw").state_dict()
    for name, value in replay.student.model.state_dict().items():
        assert torch.equal(raw[name], value), name  # without an EMA the raw student, trained alike

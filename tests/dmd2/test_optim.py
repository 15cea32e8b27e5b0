"""The optimizers' learning-rate schedule (dmd2/optim.py) as the trainer builds it (dmd2/trainer.py)."""

import pytest
import torch

from dmd2.config import ConfigError, DistillConfig, DMD2Config, ModelConfig, OptimConfig, TrainConfig
from dmd2.trainer import train_state


def config(decay_fraction: float, warmup_steps: int = 0, rollouts: int = 10) -> DistillConfig:
    return DistillConfig(model=ModelConfig(teacher="tiny"),
                         optim=OptimConfig(lr=0.5, warmup_steps=warmup_steps, decay_fraction=decay_fraction),
                         dmd2=DMD2Config(teacher_guidance_scale=2.0, critic_steps_per_rollout=2),
                         train=TrainConfig(rollouts=rollouts, rollout_batch_size=10))


def lrs_taken(config: DistillConfig, steps_per_rollout: int, steps: int) -> list[float]:
    """The learning rate each of `steps` optimizer steps of a one-parameter model uses."""
    state = train_state(torch.nn.Linear(1, 1), 0.5, config, velocity=lambda m: m, steps_per_rollout=steps_per_rollout)
    taken = []
    for _ in range(steps):
        taken.append(state.optimizer.param_groups[0]["lr"])
        state.optimizer.step()
        state.scheduler.step()
    return taken


def test_the_decay_spans_the_last_fraction_of_each_optimizers_steps_down_towards_zero():
    # The actor: 10 rollouts x 1 step, the last 30% (3 steps) decay: 0.5 * 3/3, 2/3, 1/3.
    assert lrs_taken(config(0.3), 1, 10) == pytest.approx([0.5] * 7 + [0.5, 0.5 * 2 / 3, 0.5 / 3])
    # The critic: 10 rollouts x K = 2 steps, its last 6 steps decay: 6/6 .. 1/6 of the peak.
    assert lrs_taken(config(0.3), 2, 20) == pytest.approx([0.5] * 14 + [0.5 * k / 6 for k in range(6, 0, -1)])


def test_warmup_and_decay_multiply_and_a_run_continued_past_its_end_keeps_the_last_rate():
    expected = [0.5 * min(1, (s + 1) / 4) * min(1, (10 - s) / 5) for s in range(10)] + [0.5 / 5] * 3
    assert lrs_taken(config(0.5, warmup_steps=4), 1, 13) == pytest.approx(expected)


def test_no_decay_keeps_the_rate_constant_after_the_warmup():
    assert lrs_taken(config(0.0, warmup_steps=2), 1, 5) == pytest.approx([0.25, 0.5, 0.5, 0.5, 0.5])


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_decay_fraction_outside_zero_to_one_is_refused_naming_the_option(fraction):
    with pytest.raises(ConfigError, match=r"\[optim\] decay_fraction"):
        config(fraction)

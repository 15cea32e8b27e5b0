"""The collapse guard (dmd2/guard.py, dmd2/guarded_loop.py): its rules against an explicit computation, and a digits
run (tiny UNet, in process) that collapses at a chosen rollout, trips, rolls back and goes on; a healthy run is the
unguarded run bit for bit; `on_collapse = "stop"` stops naming the rule."""

import statistics

import pytest
import torch

from dmd2.conditioning import ClassLabels
from dmd2.config import DistillConfig, DMD2Config, ModelConfig, OptimConfig, StudentConfig, TrainConfig
from dmd2.config_rules import ConfigError
from dmd2.families.digits.model import build_digits_unet
from dmd2.guard import CollapseError, CollapseGuard, Trip, rollback_step, sample_signals
from dmd2.guard_config import GuardConfig
from dmd2.guarded_loop import GuardedRun
from dmd2.loop import InProcessDistiller

INJECT_AT = 12


def test_sample_signals_match_a_loop_over_channels_and_positions():
    x = torch.randn(6, 3, 4, 4)
    signals = sample_signals(x)
    means = [x[:, c].flatten().mean() for c in range(3)]
    spreads = [((x[:, c].flatten() - means[c]) ** 2).mean().sqrt() for c in range(3)]
    across = [((x[:, c, i, j] - x[:, c, i, j].mean()) ** 2).mean().sqrt()
              for c in range(3) for i in range(4) for j in range(4)]
    assert torch.allclose(signals["guard/sample_mean"], sum(means) / 3, atol=1e-6)
    assert torch.allclose(signals["guard/sample_spread"], sum(spreads) / 3, atol=1e-6)
    assert torch.allclose(signals["guard/diversity"], sum(across) / len(across), atol=1e-6)


def _row(diversity=1.0, mean=0.0, spread=1.0, critic=0.5, grad=1.0):
    return {"guard/diversity": diversity, "guard/sample_mean": mean, "guard/sample_spread": spread,
            "critic-loss": critic, "grad_norm": grad}


def test_each_rule_trips_after_its_patience_and_names_its_onset():
    cfg = GuardConfig(warmup=5, window=10, patience=3)
    noise = [0.01 * ((i * 7) % 5 - 2) for i in range(20)]
    for rule, bad in (("diversity_drop", _row(diversity=0.1)), ("signal_outlier", _row(spread=3.0)),
                      ("grad_spike", _row(grad=50.0))):
        guard = CollapseGuard(cfg)
        for i in range(10):
            assert guard.observe(i, _row(diversity=1 + noise[i], spread=1 + noise[i], grad=1 + noise[i])) is None
        assert guard.observe(10, bad) is None and guard.tripping
        assert guard.observe(11, bad) is None
        trip = guard.observe(12, bad)
        assert (trip.rule, trip.onset, trip.rollout) == (rule, 10, 12), trip
    # the robust deviation, computed by hand: |3 - median| / (1.4826 MAD), far beyond 12
    window = [1 + n for n in noise[:10]]
    median = statistics.median(window)
    assert abs(3.0 - median) / (1.4826 * statistics.median(abs(v - median) for v in window)) > 12


def test_a_condition_that_clears_before_its_patience_does_not_trip():
    guard = CollapseGuard(GuardConfig(warmup=3, window=10, patience=3))
    rows = [_row()] * 5 + [_row(diversity=0.0)] * 2 + [_row()] * 5
    assert all(guard.observe(i, row) is None for i, row in enumerate(rows))
    assert not guard.tripping


def test_rollback_goes_to_the_newest_sound_checkpoint_before_the_onset():
    trip = Trip("diversity_drop", rollout=30, onset=24, figures="")
    assert rollback_step({0: False, 10: False, 20: True, 24: False, 30: True}, trip) == 10
    assert rollback_step({0: True}, trip) is None


def test_an_evaluation_trips_on_lost_diversity_or_a_distance_far_past_the_runs_best():
    guard = CollapseGuard(GuardConfig(eval_diversity_ratio=0.5, eval_distance_ratio=3.0))
    assert guard.judge(10, {"eval/diversity_ratio": 0.9}, gate=None) is None
    trip = guard.judge(20, {"eval/diversity_ratio": 0.3}, gate=None)
    assert (trip.rule, trip.onset, trip.rollout) == ("eval_diversity", 20, 19)  # onset: the weights after 20 rollouts
    assert trip.describe().startswith("rule eval_diversity tripped at the evaluation after rollout 19 (the student of "
                                      "20 rollouts): eval/diversity_ratio 0.3 < 0.5")
    # the gate distance: the first evaluation 10, the best 3; 9.5 is over 3 x 3 but under the first: no trip
    for step, distance in ((10, 10.0), (20, 4.0), (30, 3.0), (40, 5.0), (50, 9.5)):
        assert guard.judge(step, {"eval/fd_teacher": distance}, gate="eval/fd_teacher") is None, step
    trip = guard.judge(60, {"eval/fd_teacher": 11.0}, gate="eval/fd_teacher")
    assert (trip.rule, trip.onset) == ("eval_distance", 60) and "best 3" in trip.figures
    guard.rewind(20)  # back to the checkpoint of step 20: the later evaluations are forgotten
    assert guard.distances == [(10, 10.0), (20, 4.0)]
    off = CollapseGuard(GuardConfig(eval_diversity_ratio=0, eval_distance_ratio=0))
    assert off.judge(10, {"eval/diversity_ratio": 0.0, "eval/d": 1.0}, "eval/d") is None
    assert off.judge(20, {"eval/d": 100.0}, "eval/d") is None


def test_bad_guard_options_are_refused_naming_them():
    with pytest.raises(ConfigError, match=r"\[guard\] on_collapse"):
        GuardConfig(on_collapse="ignore")
    with pytest.raises(ConfigError, match=r"\[guard\] lr_scale must be in \(0, 1\]; got lr_scale = 0$"):
        GuardConfig(lr_scale=0)
    with pytest.raises(ConfigError, match=r"\[guard\] eval_distance_ratio"):
        GuardConfig(eval_distance_ratio=0.5)


def _config(rollouts: int, **guard) -> DistillConfig:
    return DistillConfig(model=ModelConfig(teacher="tiny"), student=StudentConfig(num_steps=2),
                         optim=OptimConfig(lr=1e-3, critic_lr=2e-3), dmd2=DMD2Config(teacher_guidance_scale=2.0,
                                                                                     critic_steps_per_rollout=2),
                         train=TrainConfig(rollouts=rollouts, rollout_batch_size=32, seed=3, save_interval=4),
                         guard=GuardConfig(warmup=6, window=20, **guard))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    torch.manual_seed(0)
    return build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)


def _distiller(config, teacher):
    return InProcessDistiller.from_models(config, teacher, ClassLabels(10, 10), (1, 8, 8))


def _collapse_at(rollout: int):
    """A hook that multiplies the student's learning rate by 1e3 once, after rollout `rollout`'s step."""
    fired = []

    def hook(distiller):
        def on_rollout(rollout_id, metrics):
            if rollout_id == rollout and not fired:
                fired.append(rollout_id)
                distiller.student.scheduler.base_lrs = [lr * 1e3 for lr in distiller.student.scheduler.base_lrs]
                for group in distiller.student.optimizer.param_groups:
                    group["lr"] *= 1e3
        return on_rollout
    return hook


def test_a_collapse_trips_the_guard_which_rolls_back_to_before_it_and_goes_on(teacher):
    distiller = _distiller(_config(24, lr_scale=0.5), teacher)
    guarded, metrics, inject = GuardedRun(distiller), {}, _collapse_at(INJECT_AT)(distiller)
    guarded.run(lambda r, m: (metrics.__setitem__(r, m), inject(r, m)))
    rollback = guarded.events[0]
    assert rollback.action == "rollback"
    assert INJECT_AT + 1 <= rollback.trip.onset and rollback.trip.rollout <= INJECT_AT + 1 + 3  # within patience
    assert rollback.restored <= INJECT_AT  # a checkpoint taken before the injected step
    assert all(step <= INJECT_AT for step in guarded.loaded)
    assert distiller.config.train.seed != 3 and distiller.student.optimizer.param_groups[0]["lr"] == 5e-4
    assert not guarded.guard.tripping and max(metrics) == 23  # it went on to the end, no rule holding


def test_with_on_collapse_stop_the_run_stops_naming_the_rule(teacher):
    distiller = _distiller(_config(24, on_collapse="stop"), teacher)
    guarded = GuardedRun(distiller)
    with pytest.raises(CollapseError, match=r"rule (signal_outlier|grad_spike|diversity_drop) tripped at rollout"):
        guarded.run(_collapse_at(INJECT_AT)(distiller))
    assert [event.action for event in guarded.events] == ["stop"]


def test_a_healthy_run_never_trips_and_its_student_is_the_unguarded_one_bit_for_bit(teacher):
    guarded = GuardedRun(_distiller(_config(24), teacher))
    guarded.run()
    plain = _distiller(_config(24, enabled=False), teacher)
    plain.run(range(24))
    assert guarded.events == []
    for (name, a), b in zip(guarded.distiller.student.model.state_dict().items(), plain.student.model.state_dict().values()):
        assert torch.equal(a, b), name

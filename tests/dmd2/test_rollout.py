import pytest
import torch

from dmd2.convert import samples_to_train_pairs
from dmd2.rollout import RolloutSamples, backward_simulate, euler_sample
from dmd2.schedule import add_noise, student_sigmas, teacher_sigmas, x0_from_velocity


class CountingModel:
    """Records which sample ids each call saw; velocity = a fixed function of x and sigma."""

    def __init__(self):
        self.seen = []

    def __call__(self, x, sigma, cond):
        self.seen.append(cond["id"].tolist())
        return 0.5 * x + sigma[:, None, None, None]


def test_student_called_exactly_i_times_before_the_step_i_pair():
    num_steps, stop = 4, torch.tensor([0, 1, 2, 3, 2, 0])
    model = CountingModel()
    cond = {"id": torch.arange(6)}
    backward_simulate(model, torch.randn(6, 1, 2, 2), student_sigmas(num_steps), stop, cond,
                      torch.randn(num_steps - 1, 6, 1, 2, 2))
    for sample, i in enumerate(stop.tolist()):
        calls = sum(sample in ids for ids in model.seen)
        assert calls == i + 1  # i steps before, one for x0_hat_i


def test_backward_simulation_matches_an_explicit_loop():
    sigmas = student_sigmas(3)
    model = CountingModel()
    noise, renoise = torch.randn(5, 1, 2, 2), torch.randn(2, 5, 1, 2, 2)
    stop = torch.tensor([0, 1, 2, 2, 1])
    cond = {"id": torch.arange(5)}
    x_i, x0_hat, sigma_i = backward_simulate(model, noise, sigmas, stop, cond, renoise)
    for b in range(5):
        x = noise[b:b + 1]
        for j in range(stop[b].item()):
            s = sigmas[j:j + 1]
            x0 = x0_from_velocity(x, s, model(x, s, {"id": torch.tensor([b])}))
            x = add_noise(x0, renoise[j, b:b + 1], sigmas[j + 1:j + 2])
        s = sigmas[stop[b]:stop[b] + 1]
        assert torch.allclose(x_i[b], x[0], atol=1e-6)
        assert torch.allclose(x0_hat[b], x0_from_velocity(x, s, model(x, s, {"id": torch.tensor([b])}))[0], atol=1e-6)
        assert sigma_i[b] == s


def test_full_trajectory_lands_on_the_clean_sample():
    model = CountingModel()
    noise = torch.randn(2, 1, 2, 2)
    x_i, x0_hat, sigma_i = backward_simulate(model, noise, student_sigmas(1), torch.tensor([1, 1]),
                                             {"id": torch.arange(2)}, torch.empty(0, 2, 1, 2, 2))
    expected = x0_from_velocity(noise, torch.ones(2), model(noise, torch.ones(2), {"id": torch.arange(2)}))
    assert torch.allclose(x0_hat, expected) and torch.equal(x_i, x0_hat) and torch.all(sigma_i == 0)


def test_euler_sampler_is_exact_for_a_constant_velocity():
    v = torch.randn(3, 1, 2, 2)
    out = euler_sample(lambda x, s, c: v, torch.zeros(3, 1, 2, 2), teacher_sigmas(7), {})
    assert torch.allclose(out, -v, atol=1e-6)  # x(0) = x(1) - integral_0^1 v


def _samples(step_index):
    n = len(step_index)
    return RolloutSamples(torch.randn(n, 1, 2, 2), torch.randn(n, 1, 2, 2), torch.rand(n), torch.tensor(step_index),
                          {"class_labels": torch.arange(n)}, {"class_labels": torch.full((n,), 10)},
                          torch.arange(100, 100 + n))


def test_converter_fields():
    samples = _samples([0, 3, 1])
    pairs = samples_to_train_pairs(samples, num_steps=4)
    assert torch.equal(pairs.latent, samples.x_i) and torch.equal(pairs.x0, samples.x0_hat)
    assert torch.equal(pairs.sigma, samples.sigma) and torch.allclose(pairs.timestep, 1000 * samples.sigma)
    assert torch.equal(pairs.step_index, samples.step_index)
    assert torch.equal(pairs.cond["class_labels"], samples.cond["class_labels"])
    assert torch.equal(pairs.neg_cond["class_labels"], samples.neg_cond["class_labels"])
    assert torch.equal(pairs.sample_index, torch.tensor([100, 101, 102]))


def test_converter_rejects_a_full_trajectory():
    with pytest.raises(ValueError, match="full 4-step trajectory.*backward simulation"):
        samples_to_train_pairs(_samples([0, 4, 1]), num_steps=4)


def test_lockstep_makes_one_call_per_grid_step_and_changes_no_sample():
    """A sharded student needs the same number of calls on every rank, whatever its stop indices."""
    num_steps, stop = 4, torch.tensor([0, 1, 0])  # nothing runs past step 1
    noise, renoise = torch.randn(3, 1, 2, 2), torch.randn(num_steps - 1, 3, 1, 2, 2)
    cond = {"id": torch.arange(3)}
    free, locked = CountingModel(), CountingModel()
    expected = backward_simulate(free, noise, student_sigmas(num_steps), stop, cond, renoise)
    got = backward_simulate(locked, noise, student_sigmas(num_steps), stop, cond, renoise, lockstep=True)
    assert len(free.seen) == 2 and len(locked.seen) == num_steps
    assert locked.seen[2:] == [[0], [0]]  # the idle steps run one row, whose result is dropped
    for one, two in zip(expected, got):
        assert torch.equal(one, two)


def _plan(stop_weights, world_size=1):
    from dmd2.plan import RolloutPlan

    return RolloutPlan(seed=3, rollout_id=7, world_size=world_size, critic_steps=4, batch=1000 // world_size,
                       sample_shape=(1, 2, 2), num_steps=4, shift=1.0, stop_weights=stop_weights)


def test_weighted_stop_steps_follow_their_weights_whatever_the_world_size():
    from dmd2.draws import shard_rows
    from dmd2.rollout import stop_indices

    plan = _plan((1.0, 2.0, 3.0, 4.0))
    rows = shard_rows(0, 1, plan.critic_steps, plan.batch)
    stops = stop_indices(plan, rows)
    frequencies = torch.bincount(stops, minlength=4).double() / len(stops)
    # 4000 draws: each frequency is within 4 standard errors (sqrt(p(1-p)/n) <= 0.008) of i+1 / 10
    assert torch.allclose(frequencies, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.032)
    halves = [stop_indices(_plan(plan.stop_weights, 2), shard_rows(rank, 2, plan.critic_steps, plan.batch // 2))
              for rank in (0, 1)]
    by_sample = dict(zip(rows.tolist(), stops.tolist()))
    for rank, half in enumerate(halves):
        assert half.tolist() == [by_sample[i] for i in shard_rows(rank, 2, plan.critic_steps, plan.batch // 2).tolist()]


def test_a_zero_weight_step_is_never_a_stop_and_no_weights_is_the_uniform_draw():
    from dmd2.draws import shard_rows
    from dmd2.rollout import stop_indices

    rows = shard_rows(0, 1, 4, 1000)
    assert set(stop_indices(_plan((0.0, 1.0, 0.0, 1.0)), rows).tolist()) == {1, 3}
    uniform = _plan(())
    assert torch.equal(stop_indices(uniform, rows), uniform.draws.integers("stop", 4, rows))

import copy
import math

import torch

from dmd2.config import DMD2Config
from dmd2.convert import TrainPairs
from dmd2.critic import critic_loss, flow_matching_loss, training_sigma
from dmd2.hooks import CRITIC_HOOKS, score
from dmd2.plan import RolloutPlan
from dmd2.trainer import HookContext, TrainState, train_steps
from dmd2.optim import make_optimizer
from dmd2.scoring import separate_critic_draw


def test_x0_space_loss_is_sigma_squared_times_velocity_loss(tiny):
    x0, eps = torch.randn(6, 1, 4, 4), torch.randn(6, 1, 4, 4)
    sigma = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 1.0])
    cond = {"class_labels": torch.arange(6)}
    v_loss, x_s, v = flow_matching_loss(tiny, x0, cond, sigma, eps, "velocity")
    x0_loss, _, _ = flow_matching_loss(tiny, x0, cond, sigma, eps, "x0")
    for b in range(6):  # explicit per-sample velocity MSE
        explicit = ((v[b] - (eps[b] - x0[b])) ** 2).mean()
        assert torch.allclose(v_loss[b], explicit, atol=1e-6)
        assert torch.allclose(x0_loss[b], sigma[b] ** 2 * explicit, rtol=1e-5, atol=1e-7)


def test_last_step_sigma_stays_inside_the_range_over_many_draws(tiny):
    low, high = 0.3, 0.45
    for seed in range(50):
        u = torch.rand(64, generator=torch.Generator().manual_seed(seed))
        _, kept = critic_loss(tiny, torch.randn(64, 1, 4, 4), {"class_labels": torch.zeros(64, dtype=torch.long)},
                              torch.arange(64), torch.randn(64, 1, 4, 4), u, shift=1.0, loss_space="velocity",
                              score_sigma_range=(low, high))
        assert kept.sigma.min() >= low and kept.sigma.max() <= high
    shifted = training_sigma(torch.tensor([0.0, 1.0]), shift=3.0, sigma_range=(low, high))
    assert torch.allclose(shifted, torch.tensor([3 * low / (1 + 2 * low), 3 * high / (1 + 2 * high)]))


def _plan(critic_steps=3, batch=4):
    return RolloutPlan(seed=1, rollout_id=0, world_size=1, critic_steps=critic_steps, batch=batch,
                       sample_shape=(1, 4, 4), num_steps=4, shift=1.0)


def _pairs(n):
    g = torch.Generator().manual_seed(0)
    return TrainPairs(torch.randn(n, 1, 4, 4, generator=g), torch.randn(n, 1, 4, 4, generator=g), torch.rand(n),
                      torch.rand(n) * 1000, torch.zeros(n, dtype=torch.long),
                      {"class_labels": torch.randint(10, (n,), generator=g)}, {"class_labels": torch.full((n,), 10)},
                      torch.arange(n))


def _critic_state(model):
    optimizer, scheduler = make_optimizer(model.parameters(), 1e-2, (0.0, 0.999), 0.0, 0)
    return TrainState(model, model, optimizer, scheduler, grad_clip=0.0)


def test_only_the_last_step_keeps_scoring_inputs_and_fused_scores_match_separate_forwards(tiny):
    plan, dmd2 = _plan(), DMD2Config(teacher_guidance_scale=3.0)
    ctx, pairs = HookContext(plan, dmd2, rank=0), _pairs(12)
    teacher = copy.deepcopy(tiny).requires_grad_(False)
    critic_before_last = {}

    def loss_spy(ctx, model, batch, step):
        if step == plan.critic_steps - 1:
            critic_before_last["model"] = copy.deepcopy(model)
        return CRITIC_HOOKS.loss(ctx, model, batch, step)

    hooks = type(CRITIC_HOOKS)(loss=loss_spy, prepare=CRITIC_HOOKS.prepare, train_output=lambda c, kept: kept)
    _, kept = train_steps(_critic_state(tiny), hooks, ctx, pairs, plan.critic_steps)
    assert kept[0] is None and kept[1] is None and kept[2] is not None
    last = kept[2]
    assert torch.equal(last.sample_index, torch.arange(8, 12))
    scores = score(teacher, last, pairs, ctx)
    # independent computation: separate critic (before its last update) and teacher forwards at kept x_s
    x_s, sigma = last.x_s, last.sigma
    cond, neg = {"class_labels": pairs.cond["class_labels"][8:]}, {"class_labels": torch.full((4,), 10)}
    with torch.no_grad():
        x0_fake = x_s - sigma[:, None, None, None] * critic_before_last["model"](x_s, sigma, cond)
        v_real = teacher(x_s, sigma, neg) + 3.0 * (teacher(x_s, sigma, cond) - teacher(x_s, sigma, neg))
    assert torch.allclose(scores.x0_fake, x0_fake, atol=1e-6)
    assert torch.allclose(scores.x0_real, x_s - sigma[:, None, None, None] * v_real, atol=1e-5)
    # the kept x_s is the student sample noised with this step's own draw, at a sigma inside the range
    rows = torch.arange(8, 12)
    eps = plan.draws.normal("critic/noise", rows, (1, 4, 4))
    expected_sigma = training_sigma(plan.draws.uniform("critic/sigma", rows), 1.0, dmd2.score_sigma_range)
    assert torch.allclose(sigma, expected_sigma)
    assert torch.allclose(x_s, (1 - sigma[:, None, None, None]) * pairs.x0[8:] + sigma[:, None, None, None] * eps)


def test_original_mode_scores_with_the_critic_before_its_last_update(tiny):
    plan = _plan()
    dmd2 = DMD2Config(critic_scoring="original", score_sigma_range=(0.2, 0.5))
    ctx, pairs = HookContext(plan, dmd2, rank=0), _pairs(12)
    snapshots = []

    def loss_spy(ctx, model, batch, step):
        snapshots.append(copy.deepcopy(model))
        return CRITIC_HOOKS.loss(ctx, model, batch, step)

    hooks = type(CRITIC_HOOKS)(loss=loss_spy, prepare=CRITIC_HOOKS.prepare, train_output=CRITIC_HOOKS.train_output)
    state = _critic_state(tiny)
    _, kept = train_steps(state, hooks, ctx, pairs, plan.critic_steps)
    draws = plan.draws
    rows = torch.arange(8, 12)
    expected = separate_critic_draw(snapshots[-1], pairs.x0[8:], {"class_labels": pairs.cond["class_labels"][8:]},
                                    rows, draws.normal("score/noise", rows, (1, 4, 4)),
                                    draws.uniform("score/sigma", rows), shift=1.0, score_sigma_range=(0.2, 0.5))
    assert torch.allclose(kept.x0_fake, expected.x0_fake) and torch.equal(kept.x_s, expected.x_s)
    with torch.no_grad():
        after = state.model(kept.x_s, kept.sigma, {"class_labels": pairs.cond["class_labels"][8:]})
    assert not torch.allclose(kept.x_s - kept.sigma[:, None, None, None] * after, kept.x0_fake)
    assert kept.sigma.min() >= 0.2 and kept.sigma.max() <= 0.5


def test_logit_normal_sigmas_follow_the_sigmoid_of_a_standard_normal_inside_the_range():
    from statistics import NormalDist

    u = torch.linspace(0.001, 0.999, 999)
    sigma = training_sigma(u, shift=1.0, sampling="logit_normal")
    normal = NormalDist()
    expected = torch.tensor([1 / (1 + math.exp(-normal.inv_cdf(p))) for p in u.tolist()])
    assert torch.allclose(sigma, expected, atol=1e-5)
    low, high = 0.02, 0.98
    ranged = training_sigma(u, shift=1.0, sigma_range=(low, high), sampling="logit_normal")
    assert ranged.min() >= low and ranged.max() <= high
    # u spreads the range by the normal CDF: the median sigma of the full range is 1/2
    assert abs(training_sigma(torch.tensor([0.5]), 1.0, (0.0, 1.0), "logit_normal").item() - 0.5) < 1e-6
    shifted = training_sigma(u, shift=3.0, sampling="logit_normal")
    assert torch.allclose(shifted, 3 * expected / (1 + 2 * expected), atol=1e-5)

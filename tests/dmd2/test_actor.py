import pytest
import torch
import torch.nn.functional as F

from dmd2.actor import actor_loss, dmd_gradient
from dmd2.convert import TrainPairs
from dmd2.scoring import Scores


def test_dmd_gradient_sign_and_per_sample_normaliser_match_a_hand_computation():
    x0_hat = torch.tensor([[[[1.0, 2.0]]], [[[0.0, 0.0]]]])
    x0_real = torch.tensor([[[[0.0, 1.0]]], [[[2.0, -2.0]]]])
    x0_fake = torch.tensor([[[[1.0, 1.0]]], [[[1.0, -1.0]]]])
    g, normaliser = dmd_gradient(x0_hat, x0_real, x0_fake)
    # sample 0: mean |x0_hat - x0_real| = 1; sample 1: mean(|-2|, |2|) = 2
    assert torch.allclose(normaliser, torch.tensor([1.0, 2.0]))
    assert torch.allclose(g, torch.tensor([[[[1.0, 0.0]]], [[[-0.5, 0.5]]]]))
    # descending on the loss moves x0_hat along -g: away from the fake score, toward the real one


def test_zero_normaliser_gives_zero_not_nan():
    x = torch.ones(1, 1, 2, 2)
    g, _ = dmd_gradient(x, x, x + 1)
    assert torch.all(torch.isfinite(g))


def test_actor_loss_gradient_wrt_x0_hat_is_g_over_numel():
    x0_hat = torch.randn(3, 1, 4, 4, requires_grad=True)
    x0_real, x0_fake = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    g, _ = dmd_gradient(x0_hat, x0_real, x0_fake)
    loss = 0.5 * F.mse_loss(x0_hat, (x0_hat - g).detach())
    loss.backward()
    assert torch.allclose(x0_hat.grad, g / x0_hat.numel(), atol=1e-7)


def _pairs(latent, x0, sigma, index):
    n = latent.shape[0]
    return TrainPairs(latent, x0, sigma, sigma * 1000, torch.zeros(n, dtype=torch.long),
                      {"class_labels": torch.zeros(n, dtype=torch.long)}, {"class_labels": torch.full((n,), 10)}, index)


def test_actor_loss_recomputes_x0_hat_and_matches_scores_by_sample_index(tiny):
    latent, sigma = torch.randn(4, 1, 4, 4), torch.tensor([1.0, 0.75, 0.5, 0.25])
    with torch.no_grad():
        x0_rollout = latent - sigma[:, None, None, None] * tiny(latent, sigma, {"class_labels": torch.zeros(4, dtype=torch.long)})
    pairs = _pairs(latent, x0_rollout, sigma, torch.tensor([7, 3, 9, 1]))
    x0_real, x0_fake = torch.randn(4, 1, 4, 4), torch.randn(4, 1, 4, 4)
    shuffled = torch.tensor([2, 0, 3, 1])  # scores arrive in another order
    scores = Scores(pairs.sample_index[shuffled], sigma[shuffled], x0_real[shuffled], x0_fake[shuffled])
    loss, metrics = actor_loss(tiny, pairs, scores)
    g, normaliser = dmd_gradient(x0_rollout, x0_real, x0_fake)
    assert torch.allclose(loss, 0.5 * (g ** 2).mean(), rtol=1e-5)
    assert metrics["x0_recompute_max_diff"] < 1e-6
    assert metrics["dmd_normaliser"] == pytest.approx(normaliser.mean().item(), rel=1e-5)


def test_actor_loss_rejects_scores_for_other_samples(tiny):
    pairs = _pairs(torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4), torch.rand(2), torch.tensor([0, 1]))
    scores = Scores(torch.tensor([0, 5]), torch.rand(2), torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4))
    with pytest.raises(ValueError, match="missing \\[1\\]"):
        actor_loss(tiny, pairs, scores)

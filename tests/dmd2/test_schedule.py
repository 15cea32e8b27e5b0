import torch

from dmd2.model import guided
from dmd2.schedule import (add_noise, cfg, shift_sigma, student_sigmas, teacher_sigmas, timestep,
                           velocity_target, x0_from_velocity)


def test_student_grid_is_uniform_without_shift():
    assert torch.allclose(student_sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25]))
    assert torch.allclose(student_sigmas(1), torch.tensor([1.0]))


def test_shift_matches_sd3_formula_and_keeps_end_points():
    sigmas = teacher_sigmas(8, shift=3.0)
    for s_shift, s in zip(sigmas.tolist(), torch.linspace(1, 0, 9).tolist()):
        assert abs(s_shift - 3 * s / (1 + 2 * s)) < 1e-6
    assert sigmas[0] == 1 and sigmas[-1] == 0
    assert torch.equal(shift_sigma(torch.tensor([0.3]), 1.0), torch.tensor([0.3]))


def test_timestep_is_thousand_sigma():
    assert torch.allclose(timestep(torch.tensor([0.25, 1.0])), torch.tensor([250.0, 1000.0]))


def test_noising_and_x0_recovery_per_sample():
    x0, eps = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    sigma = torch.tensor([0.0, 0.3, 1.0])
    x_s = add_noise(x0, eps, sigma)
    for b in range(3):
        s = sigma[b].item()
        assert torch.allclose(x_s[b], (1 - s) * x0[b] + s * eps[b])
    assert torch.allclose(x0_from_velocity(x_s, sigma, velocity_target(x0, eps)), x0, atol=1e-6)


def test_cfg_standard_form_and_identity_at_one():
    v_pos, v_neg = torch.tensor([2.0]), torch.tensor([0.5])
    assert torch.allclose(cfg(v_pos, v_neg, 3.0), torch.tensor([0.5 + 3 * 1.5]))
    assert torch.equal(cfg(v_pos, v_neg, 1.0), v_pos)


def test_guided_model_batches_both_branches(tiny):
    x, sigma = torch.randn(4, 1, 4, 4), torch.rand(4)
    cond, neg = {"class_labels": torch.tensor([1, 2, 3, 4])}, {"class_labels": torch.full((4,), 10)}
    expected = tiny(x, sigma, neg) + 2.5 * (tiny(x, sigma, cond) - tiny(x, sigma, neg))
    assert torch.allclose(guided(tiny, 2.5, neg)(x, sigma, cond), expected, atol=1e-6)
    assert guided(tiny, 1.0, neg) is tiny

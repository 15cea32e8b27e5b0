"""The explicit DMD2 rollout the family tests check the library's against: every sample on its own, in plain loops,
each model call made by the test the pipeline's way (its packing and ids, its timestep, its guidance)."""

import torch

from dmd2.draws import shard_rows
from dmd2.schedule import shift_sigma, student_sigmas

SCORE_SIGMAS = (0.02, 0.98)  # the recipes' default [dmd2] score_sigma_range


def explicit_rollout_metrics(draws, n: int, shape: tuple, prompts: int, steps: int, shift: float, student, critic,
                             teacher_x0) -> dict[str, torch.Tensor]:
    """One rollout's critic loss, DMD normaliser and actor loss over its `n` samples, from the rollout's own draws:
    the student samples down to each sample's drawn stop (re-noising between its `steps` shifted sigmas), the
    critic learns the flow at a uniform sigma (then shifted), and the actor's gradient is the critic's x0 minus the
    teacher's, over their mean absolute difference. `student(x, sigma, prompt)` and `critic(...)` are velocities,
    `teacher_x0(x_s, sigma, prompt)` the teacher's guided x0."""
    rows = shard_rows(0, 1, 1, n)
    stop, noise = draws.integers("stop", steps, rows), draws.normal("noise", rows, shape)
    renoise = [draws.normal(f"renoise/{j}", rows, shape) for j in range(steps - 1)]
    prompt, sigmas = draws.integers("cond", prompts, rows), student_sigmas(steps, shift)
    with torch.no_grad():
        x0_hat = []
        for b in range(n):
            x = noise[b]
            for j in range(int(stop[b]) + 1):
                x0 = x - sigmas[j] * student(x, sigmas[j], int(prompt[b]))
                if j == int(stop[b]):
                    x0_hat.append(x0)
                else:
                    x = (1 - sigmas[j + 1]) * x0 + sigmas[j + 1] * renoise[j][b]
        eps, u = draws.normal("critic/noise", rows, shape), draws.uniform("critic/sigma", rows)
        critic_losses, normalisers, actor_losses = [], [], []
        for b in range(n):
            s = shift_sigma(SCORE_SIGMAS[0] + (SCORE_SIGMAS[1] - SCORE_SIGMAS[0]) * u[b], shift)
            x_s = (1 - s) * x0_hat[b] + s * eps[b]
            v_fake = critic(x_s, s, int(prompt[b]))
            critic_losses.append((v_fake - (eps[b] - x0_hat[b])).pow(2).mean())
            x0_real = teacher_x0(x_s, s, int(prompt[b]))
            normaliser = (x0_hat[b] - x0_real).abs().mean()  # over every latent value of the sample
            g = ((x_s - s * v_fake) - x0_real) / normaliser
            normalisers.append(normaliser), actor_losses.append(0.5 * g.pow(2).mean())
    return {"critic-loss": torch.stack(critic_losses).mean(), "dmd_normaliser": torch.stack(normalisers).mean(),
            "loss": torch.stack(actor_losses).mean()}


def assert_the_rollout_matches(metrics: dict[str, float], expected: dict[str, torch.Tensor]) -> None:
    """The library's rollout metrics equal the explicit ones to float32's rounding over a few model calls, relative
    to each: the actor's loss is small (~5e-4) while the critic starts as the teacher's copy."""
    for key, value in expected.items():
        assert abs(metrics[key] - value.item()) <= 1e-4 * abs(value.item()) + 1e-8, (key, metrics[key], value)
    assert metrics["x0_recompute_max_diff"] < 1e-5

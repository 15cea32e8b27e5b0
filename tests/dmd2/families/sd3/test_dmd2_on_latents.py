"""One DMD2 rollout on SD3 latents (the tiny MMDiT, conditioned by prompt index through the family)
against an explicit computation: a loop over samples for the backward simulation, the fused critic
step, the teacher's guided score and the actor's DMD gradient."""

import copy

import torch

from dmd2.config import config_from_dict
from dmd2.draws import shard_rows
from dmd2.families.sd3.family import PromptIndices, SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.schedule import shift_sigma, student_sigmas
from dmd2.trainer import train_state

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign"]
SHAPE = (4, 8, 8)


def test_one_rollout_matches_an_explicit_per_sample_computation(sd3_dir, sd3_pipe):
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 3, "shift": 3.0},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": 3.0,
                                        "sigma_shift": 3.0, "critic_sigma_sampling": "logit_normal"},
        "train": {"rollout_batch_size": 6, "seed": 11},
    })
    family = SD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS, "")})
    teacher = family.load_model(str(sd3_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    plan = rollout_plan(config, 0, SHAPE)
    conds = PromptIndices(len(PROMPTS))

    # -- explicit: every sample on its own -------------------------------------------------------
    table, w = family.table, config.dmd2.teacher_guidance_scale
    draws, rows = plan.draws, shard_rows(0, 1, 1, 6)
    stop, noise = draws.integers("stop", 3, rows), draws.normal("noise", rows, SHAPE)
    renoise = [draws.normal(f"renoise/{j}", rows, SHAPE) for j in range(2)]
    prompt = draws.integers("cond", len(PROMPTS), rows)
    sigmas = student_sigmas(3, 3.0)

    def v(model, x, sigma, index):
        c = table.cond(torch.tensor([index]))
        return model(hidden_states=x[None], timestep=(1000 * sigma).reshape(1), return_dict=False,
                     encoder_hidden_states=c["encoder_hidden_states"], pooled_projections=c["pooled_projections"])[0][0]

    with torch.no_grad():
        x_i, x0_hat, sigma_i = [], [], []
        for b in range(6):
            x = noise[b]
            for j in range(int(stop[b]) + 1):
                x0 = x - sigmas[j] * v(student, x, sigmas[j], int(prompt[b]))
                if j == int(stop[b]):
                    x_i.append(x), x0_hat.append(x0), sigma_i.append(sigmas[j])
                else:
                    x = (1 - sigmas[j + 1]) * x0 + sigmas[j + 1] * renoise[j][b]
        eps, u = draws.normal("critic/noise", rows, SHAPE), draws.uniform("critic/sigma", rows)
        normal = torch.distributions.Normal(0.0, 1.0)
        low, high = normal.cdf(torch.logit(torch.tensor(0.02))), normal.cdf(torch.logit(torch.tensor(0.98)))
        critic_losses, g_abs, normalisers, actor_losses = [], [], [], []
        for b in range(6):
            s = shift_sigma(torch.sigmoid(normal.icdf(low + (high - low) * u[b])), 3.0)
            x_s = (1 - s) * x0_hat[b] + s * eps[b]
            v_fake = v(critic, x_s, s, int(prompt[b]))
            critic_losses.append((v_fake - (eps[b] - x0_hat[b])).pow(2).mean())
            x0_fake = x_s - s * v_fake
            v_neg, v_pos = v(teacher, x_s, s, -1), v(teacher, x_s, s, int(prompt[b]))
            x0_real = x_s - s * (v_neg + w * (v_pos - v_neg))
            normaliser = (x0_hat[b] - x0_real).abs().mean()
            g = (x0_fake - x0_real) / normaliser
            g_abs.append(g.abs().mean()), normalisers.append(normaliser), actor_losses.append(0.5 * g.pow(2).mean())

    # -- the library: one rollout of the in-process loop -----------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity), family.velocity(teacher), conds)
    expected = {"critic-loss": torch.stack(critic_losses).mean(), "dmd_grad_abs": torch.stack(g_abs).mean(),
                "dmd_normaliser": torch.stack(normalisers).mean(), "loss": torch.stack(actor_losses).mean()}
    for key, value in expected.items():
        assert abs(metrics[key] - value.item()) <= 1e-4 * max(1.0, abs(value.item())), (key, metrics[key], value)
    assert metrics["x0_recompute_max_diff"] < 1e-5

"""One DMD2 rollout on FLUX latents (the tiny FluxTransformer2DModel conditioned by prompt index through the family's
table) against an explicit computation, sample by sample, each model call made the pipeline's way: its packing and
ids, timestep = sigma, the guidance input (the student's and the critic's at the recipe's scale, the teacher's real
score at `teacher_guidance_scale` with no negative branch)."""

import copy

import torch
from diffusers import FluxPipeline

from dmd2.config import config_from_dict
from dmd2.draws import shard_rows
from dmd2.families.flux.family import FluxFamily
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.prompt_index import PromptIndices
from dmd2.schedule import shift_sigma, student_sigmas
from dmd2.trainer import train_state

PROMPTS = ["a photo of a cat", "a red dog on the sign", "the blue sign"]
SHAPE = (4, 8, 8)  # 16 x 16 px: 8 x 8 latent cells, 4 x 4 tokens
SHIFT, GUIDANCE = 1.5, 3.0


def test_one_rollout_on_flux_latents_matches_an_explicit_per_sample_computation(flux_dir, flux_pipe):
    config = config_from_dict({
        "model": {"family": "flux", "teacher": str(flux_dir)}, "student": {"num_steps": 3, "shift": SHIFT},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": GUIDANCE,
                                        "sigma_shift": SHIFT},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })
    with torch.no_grad():
        embeds, pooled, text_ids = flux_pipe.encode_prompt(PROMPTS, max_sequence_length=8)
    tables = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": embeds[:1],
              "negative_pooled_prompt_embeds": pooled[:1]}
    family = FluxFamily(guidance=GUIDANCE).bind({"prompts": tables})
    teacher = family.load_model(str(flux_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, the embeddings and the layout straight from the pipeline -----------------
    n = 4
    draws, rows = plan.draws, shard_rows(0, 1, 1, n)
    stop, noise = draws.integers("stop", 3, rows), draws.normal("noise", rows, SHAPE)
    renoise = [draws.normal(f"renoise/{j}", rows, SHAPE) for j in range(2)]
    prompt = draws.integers("cond", len(PROMPTS), rows)
    sigmas = student_sigmas(3, SHIFT)
    image_ids = FluxPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)

    def v(model, x, sigma, index, guidance=GUIDANCE):
        packed = FluxPipeline._pack_latents(x[None], 1, 4, 8, 8)
        out = model(hidden_states=packed, timestep=sigma.reshape(1), guidance=torch.full([1], guidance),
                    pooled_projections=pooled[index:index + 1], encoder_hidden_states=embeds[index:index + 1],
                    txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, 16, 16, 2)[0]

    with torch.no_grad():
        x0_hat = []
        for b in range(n):
            x = noise[b]
            for j in range(int(stop[b]) + 1):
                x0 = x - sigmas[j] * v(student, x, sigmas[j], int(prompt[b]))
                if j == int(stop[b]):
                    x0_hat.append(x0)
                else:
                    x = (1 - sigmas[j + 1]) * x0 + sigmas[j + 1] * renoise[j][b]
        eps, u = draws.normal("critic/noise", rows, SHAPE), draws.uniform("critic/sigma", rows)
        critic_losses, normalisers, actor_losses = [], [], []
        for b in range(n):
            s = shift_sigma(0.02 + (0.98 - 0.02) * u[b], SHIFT)  # uniform in score_sigma_range, then the shift
            x_s = (1 - s) * x0_hat[b] + s * eps[b]
            v_fake = v(critic, x_s, s, int(prompt[b]))
            critic_losses.append((v_fake - (eps[b] - x0_hat[b])).pow(2).mean())
            x0_real = x_s - s * v(teacher, x_s, s, int(prompt[b]), GUIDANCE)  # the guidance input, no CFG
            normaliser = (x0_hat[b] - x0_real).abs().mean()
            g = ((x_s - s * v_fake) - x0_real) / normaliser
            normalisers.append(normaliser), actor_losses.append(0.5 * g.pow(2).mean())

    # -- the library: one rollout of the in-process loop ---------------------------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity), family.velocity(teacher),
                          PromptIndices(len(PROMPTS)))
    expected = {"critic-loss": torch.stack(critic_losses).mean(), "dmd_normaliser": torch.stack(normalisers).mean(),
                "loss": torch.stack(actor_losses).mean()}
    for key, value in expected.items():
        assert abs(metrics[key] - value.item()) <= 1e-4 * max(1.0, abs(value.item())), (key, metrics[key], value)
    assert metrics["x0_recompute_max_diff"] < 1e-5

"""One DMD2 rollout on Wan's 5-D video latents [C, F, H, W] (the tiny WanTransformer3DModel, conditioned by prompt
index through the family's table of UMT5 embeddings) against an explicit computation, sample by sample."""

import copy

import torch

from dmd2.config import config_from_dict
from dmd2.draws import shard_rows
from dmd2.families.sd3.family import PromptIndices
from dmd2.families.wan.family import WanFamily
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.schedule import shift_sigma, student_sigmas
from dmd2.trainer import train_state
from tests.dmd2.families.wan.tiny_pipeline import FLOW_SHIFT

PROMPTS = ["a cat runs", "a red ball on the grass", "the dog jumps"]
SHAPE = (4, 2, 2, 2)  # 5 frames of 16 x 16 px: C, (5 - 1) / 4 + 1, 16 / 8, 16 / 8
MAX_TOKENS = 16


def test_the_prompt_table_is_the_pipelines_own_encoding(wan_dir, wan_pipe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = config_from_dict({"model": {"family": "wan", "teacher": str(wan_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": MAX_TOKENS, "frames": 5,
                                        "resolution": 16, "negative_prompt": "blurry"}})
    table = WanFamily().prepare(config)["prompts"]
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS + PROMPTS):  # training prompts, then the eval prompts (the first four)
            embeds, _ = wan_pipe.encode_prompt([prompt], do_classifier_free_guidance=False,
                                               max_sequence_length=MAX_TOKENS)
            assert torch.allclose(table["prompt_embeds"][row], embeds[0], atol=1e-6)
        negative, _ = wan_pipe.encode_prompt(["blurry"], do_classifier_free_guidance=False,
                                             max_sequence_length=MAX_TOKENS)
    assert torch.allclose(table["negative_prompt_embeds"], negative, atol=1e-6)


def test_one_rollout_on_video_latents_matches_an_explicit_per_sample_computation(wan_dir, wan_pipe):
    config = config_from_dict({
        "model": {"family": "wan", "teacher": str(wan_dir)}, "student": {"num_steps": 3, "shift": FLOW_SHIFT},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": 3.0,
                                        "sigma_shift": FLOW_SHIFT},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })
    with torch.no_grad():
        embeds, negative = wan_pipe.encode_prompt(PROMPTS, negative_prompt=[""] * 3, max_sequence_length=MAX_TOKENS)
    family = WanFamily().bind({"prompts": {"prompt_embeds": embeds, "negative_prompt_embeds": negative[:1]}})
    teacher = family.load_model(str(wan_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, the embeddings straight from the pipeline ------------------------------
    w, n = config.dmd2.teacher_guidance_scale, 4
    draws, rows = plan.draws, shard_rows(0, 1, 1, n)
    stop, noise = draws.integers("stop", 3, rows), draws.normal("noise", rows, SHAPE)
    renoise = [draws.normal(f"renoise/{j}", rows, SHAPE) for j in range(2)]
    prompt = draws.integers("cond", len(PROMPTS), rows)
    sigmas = student_sigmas(3, FLOW_SHIFT)

    def v(model, x, sigma, index):
        text = negative[:1] if index < 0 else embeds[index:index + 1]
        return model(hidden_states=x[None], timestep=(1000 * sigma).reshape(1), encoder_hidden_states=text,
                     return_dict=False)[0][0]

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
            s = shift_sigma(0.02 + (0.98 - 0.02) * u[b], FLOW_SHIFT)  # uniform in score_sigma_range, then the shift
            x_s = (1 - s) * x0_hat[b] + s * eps[b]
            v_fake = v(critic, x_s, s, int(prompt[b]))
            critic_losses.append((v_fake - (eps[b] - x0_hat[b])).pow(2).mean())
            v_neg, v_pos = v(teacher, x_s, s, -1), v(teacher, x_s, s, int(prompt[b]))
            x0_real = x_s - s * (v_neg + w * (v_pos - v_neg))
            normaliser = (x0_hat[b] - x0_real).abs().mean()  # over C, F, H, W
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

"""One DMD2 rollout on Qwen-Image latents (the tiny QwenImageTransformer2DModel conditioned by prompt index through
the family's padded table) against an explicit computation, sample by sample, each model call made the pipeline's way
on each prompt's own unpadded embedding: its packing and img_shapes, timestep = sigma, and the teacher's real score
by its true CFG with norm rescaling."""

import copy

import torch
from diffusers import QwenImagePipeline

from dmd2.config import config_from_dict
from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.families.qwen_image.prompts import encode_prompt_table
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.prompt_index import PromptIndices
from dmd2.trainer import train_state
from tests.dmd2.families.explicit_rollout import assert_the_rollout_matches, explicit_rollout_metrics

PROMPTS = ["a cat", "a red dog on the sign", "the blue sign"]
SHAPE = (4, 4, 4)  # 16 x 16 px: 4 x 4 latent cells, 2 x 2 tokens
SHIFT, GUIDANCE, TOKENS = 1.5, 4.0, 64


def test_one_rollout_on_qwen_image_latents_matches_an_explicit_per_sample_computation(qwen_image_dir,
                                                                                      qwen_image_pipe):
    pipe = qwen_image_pipe
    config = config_from_dict({
        "model": {"family": "qwen_image", "teacher": str(qwen_image_dir)}, "student": {"num_steps": 3, "shift": SHIFT},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": GUIDANCE,
                                        "sigma_shift": SHIFT},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })
    family = QwenImageFamily().bind({"prompts": encode_prompt_table(pipe, PROMPTS, " ", TOKENS)})
    with torch.no_grad():
        texts = [pipe.encode_prompt([p], max_sequence_length=TOKENS)[0] for p in [*PROMPTS, " "]]  # each unpadded
    teacher = family.load_model(str(qwen_image_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, each prompt's embedding straight from the pipeline ----------------------
    n = 4

    def tokens(model, x, sigma, index):
        return model(hidden_states=QwenImagePipeline._pack_latents(x[None, None], 1, 4, 4, 4),
                     timestep=sigma.reshape(1), encoder_hidden_states=texts[index], img_shapes=[[(1, 2, 2)]],
                     return_dict=False)[0]

    def v(model, x, sigma, index):
        return QwenImagePipeline._unpack_latents(tokens(model, x, sigma, index), 16, 16, 4)[0, :, 0]

    def v_true_cfg(model, x, sigma, index):  # QwenImagePipeline.__call__'s true CFG
        noise_pred, neg_noise_pred = tokens(model, x, sigma, index), tokens(model, x, sigma, -1)
        comb_pred = neg_noise_pred + GUIDANCE * (noise_pred - neg_noise_pred)
        comb_pred = comb_pred * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(comb_pred, dim=-1,
                                                                                          keepdim=True))
        return QwenImagePipeline._unpack_latents(comb_pred, 16, 16, 4)[0, :, 0]

    expected = explicit_rollout_metrics(
        plan.draws, n, SHAPE, len(PROMPTS), 3, SHIFT, lambda x, s, i: v(student, x, s, i),
        lambda x, s, i: v(critic, x, s, i), lambda x_s, s, i: x_s - s * v_true_cfg(teacher, x_s, s, i))

    # -- the library: one rollout of the in-process loop ---------------------------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity), family.velocity(teacher),
                          PromptIndices(len(PROMPTS)))
    assert_the_rollout_matches(metrics, expected)

"""One DMD2 rollout on FLUX latents (the tiny FluxTransformer2DModel conditioned by prompt index through the family's
table) against an explicit computation, sample by sample, each model call made the pipeline's way: its packing and
ids, timestep = sigma, the guidance input (the student's and the critic's at the recipe's scale, the teacher's real
score at `teacher_guidance_scale` with no negative branch)."""

import copy

import torch
from diffusers import FluxPipeline

from dmd2.config import config_from_dict
from dmd2.families.flux.family import FluxFamily
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.prompt_index import PromptIndices
from dmd2.trainer import train_state
from tests.dmd2.families.explicit_rollout import assert_the_rollout_matches, explicit_rollout_metrics

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
    with torch.no_grad():  # a critic a little off the teacher: at the same guidance input a copy scores as it does,
        generator = torch.Generator().manual_seed(1)  # and the actor's DMD gradient would be exactly 0
        for param in critic.parameters():
            param.add_(1e-2 * torch.randn(param.shape, generator=generator))
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, the embeddings and the layout straight from the pipeline -----------------
    n = 4
    image_ids = FluxPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)

    def v(model, x, sigma, index, guidance=GUIDANCE):
        packed = FluxPipeline._pack_latents(x[None], 1, 4, 8, 8)
        out = model(hidden_states=packed, timestep=sigma.reshape(1), guidance=torch.full([1], guidance),
                    pooled_projections=pooled[index:index + 1], encoder_hidden_states=embeds[index:index + 1],
                    txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, 16, 16, 2)[0]

    expected = explicit_rollout_metrics(
        plan.draws, n, SHAPE, len(PROMPTS), 3, SHIFT, lambda x, s, i: v(student, x, s, i),
        lambda x, s, i: v(critic, x, s, i), lambda x_s, s, i: x_s - s * v(teacher, x_s, s, i, GUIDANCE))  # no CFG

    # -- the library: one rollout of the in-process loop ---------------------------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity), family.velocity(teacher),
                          PromptIndices(len(PROMPTS)))
    assert_the_rollout_matches(metrics, expected)

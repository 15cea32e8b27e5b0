"""One DMD2 rollout on FLUX.2 [klein] latents (the tiny Flux2Transformer2DModel conditioned by prompt index through the
family's table) against an explicit computation, sample by sample, each model call made the pipeline's way: its
packing and 4-D ids (`Flux2KleinPipeline`'s own helpers), timestep = sigma, no guidance input, and the teacher's real
score as the pipeline guides its base model: CFG over the negative prompt at `teacher_guidance_scale`."""

import copy

import torch
from diffusers import Flux2KleinPipeline

from dmd2.config import config_from_dict
from dmd2.families.flux.klein.family import Flux2KleinFamily
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.prompt_index import PromptIndices
from dmd2.trainer import train_state
from tests.dmd2.families.explicit_rollout import assert_the_rollout_matches, explicit_rollout_metrics

PROMPTS = ["a photo of a cat", "a red dog on the sign", "the blue sign"]
SHAPE = (16, 4, 4)  # 16 x 16 px: 8 x 8 VAE cells, patchified 2 x 2 into 4 x 4 tokens of 16 channels
SHIFT, GUIDANCE = 1.5, 3.0


def test_one_rollout_on_klein_latents_matches_an_explicit_per_sample_computation(klein_dir, klein_pipe):
    config = config_from_dict({
        "model": {"family": "flux2_klein", "teacher": str(klein_dir)}, "student": {"num_steps": 3, "shift": SHIFT},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": GUIDANCE,
                                        "sigma_shift": SHIFT},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })
    with torch.no_grad():
        embeds, _ = klein_pipe.encode_prompt(PROMPTS, max_sequence_length=8)
        negative, _ = klein_pipe.encode_prompt([""], max_sequence_length=8)
    family = Flux2KleinFamily().bind({"prompts": {"prompt_embeds": embeds, "negative_prompt_embeds": negative}})
    teacher = family.load_model(str(klein_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    with torch.no_grad():  # a critic a little off the teacher, or the actor's DMD gradient would be CFG's alone
        generator = torch.Generator().manual_seed(1)
        for param in critic.parameters():
            param.add_(1e-2 * torch.randn(param.shape, generator=generator))
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, the embeddings and the layout straight from the pipeline -----------------
    text_ids = Flux2KleinPipeline._prepare_text_ids(embeds[:1])

    def v(model, x, sigma, text):
        image_ids = Flux2KleinPipeline._prepare_latent_ids(x[None])
        out = model(hidden_states=Flux2KleinPipeline._pack_latents(x[None]), timestep=sigma.reshape(1), guidance=None,
                    encoder_hidden_states=text[None], txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        return Flux2KleinPipeline._unpack_latents_with_ids(out, image_ids, *SHAPE[1:])[0]

    def real_x0(x_s, sigma, index):  # the pipeline's CFG: uncond + scale (cond - uncond)
        uncond = v(teacher, x_s, sigma, negative[0])
        return x_s - sigma * (uncond + GUIDANCE * (v(teacher, x_s, sigma, embeds[index]) - uncond))

    expected = explicit_rollout_metrics(
        plan.draws, 4, SHAPE, len(PROMPTS), 3, SHIFT, lambda x, s, i: v(student, x, s, embeds[i]),
        lambda x, s, i: v(critic, x, s, embeds[i]), real_x0)

    # -- the library: one rollout of the in-process loop ---------------------------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity),
                          family.velocity(teacher), PromptIndices(len(PROMPTS)))
    assert_the_rollout_matches(metrics, expected)

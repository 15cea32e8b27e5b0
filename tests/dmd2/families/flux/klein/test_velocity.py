"""The flux2_klein family's model call against Flux2KleinPipeline's own, observed while the pipeline samples: the
prompt table is the embeddings its `__call__` feeds the transformer, the velocity is its transformer's output on its
own packed latents, 4-D ids and timestep (sigma), and the guided teacher is the velocity its CFG steps the latents
with (read off its scheduler's Euler steps)."""

import torch

from dmd2.config import config_from_dict
from dmd2.families.flux.klein.family import Flux2KleinFamily
from dmd2.model import guided
from dmd2.prompt_index import negative_indices, prompt_indices
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole

PROMPTS = ["a photo of a cat", "a red dog on the sign"]
TOKENS = 24  # longer than the prompts in their chat template: the padding's states count too
HEIGHT, WIDTH = 4, 6  # patches: a 16 x 24 px picture, not square
GUIDANCE = 3.0


def recipe(teacher, tmp_path, prompts, **data):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return config_from_dict({"model": {"family": "flux2_klein", "teacher": str(teacher)},
                             "data": {"prompts": str(path), "max_sequence_length": TOKENS, "resolution": 16, **data}})


def sample_observed(pipe, latents):
    """Flux2KleinPipeline's 2-step guided sampling of PROMPTS from `latents`: every transformer call's inputs and
    output (cond and uncond per step), and the packed latents after each step."""
    calls, after = [], []
    hook = pipe.transformer.register_forward_hook(lambda _, args, kwargs, out: calls.append((kwargs, out[0])),
                                                  with_kwargs=True)
    try:
        pipe(prompt=PROMPTS, latents=latents, height=4 * HEIGHT, width=4 * WIDTH, num_inference_steps=2,
             guidance_scale=GUIDANCE, max_sequence_length=TOKENS, output_type="latent",
             callback_on_step_end=lambda _, i, t, kwargs: after.append(kwargs["latents"].clone()) or {})
    finally:
        hook.remove()
    return calls, after


def test_the_table_the_velocity_and_the_guided_teacher_are_the_pipelines(klein_dir, klein_pipe, tmp_path):
    pipe = klein_pipe
    table = Flux2KleinFamily().prepare(recipe(klein_dir, tmp_path, PROMPTS, negative_prompt=""))["prompts"]
    latents = torch.randn(2, 16, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        calls, after = sample_observed(pipe, latents)
        assert len(calls) == 4  # two steps, each a conditional and an unconditional call
        torch.testing.assert_close(calls[0][0]["encoder_hidden_states"], table["prompt_embeds"][:2], atol=1e-6, rtol=0)
        torch.testing.assert_close(calls[1][0]["encoder_hidden_states"],
                                   table["negative_prompt_embeds"].expand(2, -1, -1),
                                   atol=1e-6, rtol=0)  # the pipeline's negative prompt is "" ([data] negative_prompt)
        velocity = Flux2KleinFamily().bind({"prompts": table}).velocity(pipe.transformer)
        cond = prompt_indices(torch.tensor([0, 1]))
        sigmas, packed = pipe.scheduler.sigmas, [pipe._pack_latents(latents), *after]
        for step in range(2):
            inputs, output = calls[2 * step]
            ids = inputs["img_ids"]
            x_s = pipe._unpack_latents_with_ids(inputs["hidden_states"], ids, HEIGHT, WIDTH)
            v = velocity(x_s, inputs["timestep"], cond)
            torch.testing.assert_close(v, pipe._unpack_latents_with_ids(output, ids, HEIGHT, WIDTH), atol=1e-6, rtol=0)
            stepped = (packed[step + 1] - packed[step]) / (sigmas[step + 1] - sigmas[step])  # its Euler step's v
            teacher = guided(velocity, GUIDANCE, negative_indices(2))(x_s, inputs["timestep"], cond)
            torch.testing.assert_close(teacher, pipe._unpack_latents_with_ids(stepped, ids, HEIGHT, WIDTH),
                                       atol=2e-5, rtol=0)
            assert (teacher - v).abs().max() > 1e-3  # the guidance matters


def test_parts_encoded_by_several_workers_merge_into_the_table_one_worker_makes(klein_dir, tmp_path):
    """10 prompts and the first 4 again as the eval set: 14 rows, 2 encoder batches, one per part."""
    config = recipe(klein_dir, tmp_path, [f"{PROMPTS[i % 2]} {i}" for i in range(10)])
    parts = assert_parts_merge_to_the_whole(Flux2KleinFamily(), config, 2)
    assert [len(part["prompts"]["prompt_embeds"]) for part in parts] == [8, 6]

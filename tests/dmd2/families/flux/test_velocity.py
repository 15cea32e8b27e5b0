"""The flux family's model call against FluxPipeline's own: the prompt table is the pipeline's `encode_prompt`, and the
velocity is the pipeline's transformer call on its own packed latents, ids, timestep (sigma) and guidance input."""

import pytest
import torch

from dmd2.config import config_from_dict
from dmd2.families.flux.family import FluxFamily
from dmd2.model import guided
from dmd2.prompt_index import negative_indices, prompt_indices
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole

PROMPTS = ["a photo of a cat", "a red dog on the sign", "the blue sign"]
TOKENS = 8


def test_the_prompt_table_is_the_pipelines_own_encoding(flux_dir, flux_pipe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = config_from_dict({"model": {"family": "flux", "teacher": str(flux_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": TOKENS, "resolution": 16,
                                        "negative_prompt": "blurry"}})
    table = FluxFamily().prepare(config)["prompts"]
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS + PROMPTS):  # the training prompts, then the eval prompts
            embeds, pooled, _ = flux_pipe.encode_prompt([prompt], prompt_2=None, max_sequence_length=TOKENS)
            assert torch.allclose(table["prompt_embeds"][row], embeds[0], atol=1e-6)
            assert torch.allclose(table["pooled_prompt_embeds"][row], pooled[0], atol=1e-6)
        negative, negative_pooled, _ = flux_pipe.encode_prompt(["blurry"], max_sequence_length=TOKENS)
    assert torch.allclose(table["negative_prompt_embeds"], negative, atol=1e-6)
    assert torch.allclose(table["negative_pooled_prompt_embeds"], negative_pooled, atol=1e-6)


def test_parts_encoded_by_several_workers_merge_into_the_table_one_worker_makes(flux_dir, tmp_path):
    """10 prompts and the first 4 again as the eval set: 14 rows, 2 encoder batches, one per part."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(10)) + "\n")
    config = config_from_dict({"model": {"family": "flux", "teacher": str(flux_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": TOKENS, "resolution": 16}})
    parts = assert_parts_merge_to_the_whole(FluxFamily(), config, 2)
    assert [len(part["prompts"]["prompt_embeds"]) for part in parts] == [8, 6]


def test_the_velocity_is_the_pipelines_transformer_call(flux_dir, flux_pipe):
    """FluxPipeline.__call__'s model call, built with the pipeline's own prepare_latents (packing, img_ids),
    encode_prompt (txt_ids), timestep t / 1000 and guidance; the guided teacher is the same call at the guidance
    scale, with no negative branch."""
    with torch.no_grad():
        embeds, pooled, text_ids = flux_pipe.encode_prompt(PROMPTS[:2], max_sequence_length=TOKENS)
        negative, negative_pooled, _ = flux_pipe.encode_prompt([""], max_sequence_length=TOKENS)
    tables = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": negative,
              "negative_pooled_prompt_embeds": negative_pooled}
    family = FluxFamily(guidance=2.5).bind({"prompts": tables})
    transformer = flux_pipe.transformer
    packed, image_ids = flux_pipe.prepare_latents(2, 4, 32, 16, embeds.dtype, "cpu", torch.Generator().manual_seed(0))
    latents = flux_pipe._unpack_latents(packed, 32, 16, flux_pipe.vae_scale_factor)  # [2, 4, 16, 8]: not square
    sigma = torch.tensor([0.8, 0.3])

    def pipeline_call(guidance: float) -> torch.Tensor:
        out = transformer(hidden_states=packed, timestep=(sigma * 1000) / 1000, guidance=torch.full([2], guidance),
                          pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids,
                          return_dict=False)[0]
        return flux_pipe._unpack_latents(out, 32, 16, flux_pipe.vae_scale_factor)

    with torch.no_grad():
        velocity = family.velocity(transformer)
        v = velocity(latents, sigma, prompt_indices(torch.tensor([0, 1])))
        assert torch.allclose(v, pipeline_call(2.5), atol=1e-6)
        teacher = guided(velocity, 4.0, negative_indices(2))(latents, sigma, prompt_indices(torch.tensor([0, 1])))
        assert torch.allclose(teacher, pipeline_call(4.0), atol=1e-6)
        assert (teacher - v).abs().max() > 1e-4  # the guidance input matters


def test_the_guidance_input_is_kept_through_the_precision_and_host_wrappers(flux_pipe):
    """How a rank and an evaluator call the teacher (`Autocast`, `HostCalls` around the family's velocity): the guided
    teacher is still the guidance input at the scale, computed under autocast, not CFG around the wrappers."""
    from dmd2.model import HostCalls
    from dmd2.precision import Autocast

    with torch.no_grad():
        embeds, pooled, _ = flux_pipe.encode_prompt(PROMPTS[:2], max_sequence_length=TOKENS)
    tables = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": embeds[:1],
              "negative_pooled_prompt_embeds": pooled[:1]}
    x, sigma, cond = torch.randn(2, 4, 8, 8), torch.tensor([0.9, 0.4]), prompt_indices(torch.tensor([1, 0]))
    student = FluxFamily(guidance=2.5).bind({"prompts": tables}).velocity(flux_pipe.transformer)
    at_scale = FluxFamily(guidance=4.0).bind({"prompts": tables}).velocity(flux_pipe.transformer)
    with torch.no_grad():
        teacher = guided(HostCalls(Autocast(student, "cpu"), torch.device("cpu")), 4.0, negative_indices(2))
        assert torch.equal(teacher(x, sigma, cond), Autocast(at_scale, "cpu")(x, sigma, cond))



def test_a_transformer_without_the_guidance_input_is_guided_by_plain_cfg(flux_pipe):
    """FLUX.1 [schnell]'s layout (no `guidance_embeds`): the guided teacher is CFG over the negative prompt."""
    from dmd2.families.flux.velocity import FluxVelocity
    from dmd2.flow_pipeline.prompts import PromptTable
    from dmd2.schedule import cfg
    from tests.dmd2.families.flux.tiny_pipeline import tiny_flux_transformer

    with torch.no_grad():
        embeds, pooled, _ = flux_pipe.encode_prompt(PROMPTS, max_sequence_length=TOKENS)
    table = PromptTable(embeds[:2], pooled[:2], embeds[2:], pooled[2:])  # the negative prompt: the third
    velocity = FluxVelocity(tiny_flux_transformer(guidance_embeds=False), table, guidance=3.5)
    x, sigma, cond = torch.randn(2, 4, 8, 8), torch.tensor([0.9, 0.4]), prompt_indices(torch.tensor([1, 0]))
    with torch.no_grad():
        expected = cfg(velocity(x, sigma, cond), velocity(x, sigma, negative_indices(2)), 3.0)
        torch.testing.assert_close(guided(velocity, 3.0, negative_indices(2))(x, sigma, cond), expected)


def test_true_cfg_on_top_of_the_guidance_input_is_the_pipelines(flux_dir, flux_pipe, tmp_path):
    """`[dmd2] teacher_true_cfg_scale`: FluxPipeline's true CFG (both branches at the guidance input, the negative
    prompt's on the negative branch), bound by the family from the recipe; the other families refuse the option."""
    from dmd2.config import ConfigError
    from dmd2.family import check_family

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    recipe = {"model": {"teacher": str(flux_dir)}, "data": {"prompts": str(prompts), "resolution": 16},
              "dmd2": {"teacher_guidance_scale": 3.0, "teacher_true_cfg_scale": 2.0}}
    config = FluxFamily().resolve(config_from_dict(recipe), tmp_path)
    check_family("flux", config)
    with pytest.raises(ConfigError, match=r"teacher_true_cfg_scale = 2\.0: not read by the sd3 family"):
        check_family("sd3", config)
    with torch.no_grad():
        embeds, pooled, text_ids = flux_pipe.encode_prompt(PROMPTS, max_sequence_length=TOKENS)
    tables = {"prompt_embeds": embeds[:2], "pooled_prompt_embeds": pooled[:2], "negative_prompt_embeds": embeds[2:],
              "negative_pooled_prompt_embeds": pooled[2:]}
    family = FluxFamily().run_spec(config, tmp_path).family.bind({"prompts": tables})
    packed, image_ids = flux_pipe.prepare_latents(1, 4, 16, 16, embeds.dtype, "cpu", torch.Generator().manual_seed(0))
    latents, sigma = flux_pipe._unpack_latents(packed, 16, 16, flux_pipe.vae_scale_factor), torch.tensor([0.6])

    def pipeline_call(row: int) -> torch.Tensor:  # FluxPipeline.__call__'s, at guidance_scale 3
        return flux_pipe.transformer(hidden_states=packed, timestep=sigma, guidance=torch.full([1], 3.0),
                                     pooled_projections=pooled[row:row + 1], encoder_hidden_states=embeds[row:row + 1],
                                     txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]

    with torch.no_grad():
        noise_pred, neg_noise_pred = pipeline_call(1), pipeline_call(2)
        expected = neg_noise_pred + 2.0 * (noise_pred - neg_noise_pred)  # true_cfg_scale 2, negative prompt: row 2
        teacher = guided(family.velocity(flux_pipe.transformer), 3.0, negative_indices(1))
        got = teacher(latents, sigma, prompt_indices(torch.tensor([1])))
    torch.testing.assert_close(got, flux_pipe._unpack_latents(expected, 16, 16, flux_pipe.vae_scale_factor),
                               atol=1e-5, rtol=0)

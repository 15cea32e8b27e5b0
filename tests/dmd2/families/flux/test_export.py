"""A FLUX student's export: a FluxPipeline whose stock 4-step call samples as the project's student sampler, and a LoRA
student's adapter alone, which `FluxPipeline.load_lora_weights` loads onto the teacher to compute the merged export's
velocity."""

import torch

from dmd2.config import config_from_dict
from dmd2.families.flux.family import FluxFamily
from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.flow_pipeline.export import LORA_DIR
from dmd2.lora import add_adapters
from dmd2.prompt_index import prompt_indices
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas

GUIDANCE = 2.0
SHAPE = (1, 4, 8, 8)  # one 16 x 16 picture's latents


def resolved(flux_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(flux_dir)}, "student": {"num_steps": 4},
                               "data": {"prompts": str(prompts), "resolution": 16},
                               "dmd2": {"teacher_guidance_scale": GUIDANCE}})
    return FluxFamily().resolve(config, tmp_path)


def test_the_exported_pipeline_samples_as_the_students_sampler(flux_dir, tmp_path):
    from diffusers import FluxPipeline

    config = resolved(flux_dir, tmp_path)
    family = FluxFamily()
    family.export(family.load_model(str(flux_dir)), config, tmp_path / "student", {"scores": {"eval/x": 0.5}})
    pipe = FluxPipeline.from_pretrained(tmp_path / "student")
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator, in the packed layout
    latents = pipe(["a photo of a cat"], num_inference_steps=4, guidance_scale=GUIDANCE, height=16, width=16,
                   max_sequence_length=8, generator=torch.Generator().manual_seed(5), output_type="latent").images
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([unpack(torch.randn(pack(noise).shape), 8, 8) for _ in range(3)])
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(["a photo of a cat"], max_sequence_length=8)
        bound = family.run_spec(config, tmp_path).family.bind({"prompts": {
            "prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": embeds,
            "negative_pooled_prompt_embeds": pooled}})
        _, x0, _ = backward_simulate(bound.velocity(pipe.transformer), noise,
                                     student_sigmas(4, config.student.grid_shift), torch.full((1,), 4),
                                     prompt_indices(torch.zeros(1)), renoise)
    assert torch.allclose(unpack(latents, 8, 8), x0, atol=1e-5)
    card = (tmp_path / "student" / "README.md").read_text()
    assert "distilled to 4 steps with DMD2" in card and f"guidance_scale={GUIDANCE:g}" in card


def test_the_exported_adapter_loads_into_the_teacher_pipeline_as_the_merged_export(flux_dir, tmp_path):
    from diffusers import FluxPipeline

    family = FluxFamily()
    student = add_adapters(family.load_model(str(flux_dir)), 2, 2.0, family.lora_targets, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    family.export(student, resolved(flux_dir, tmp_path), tmp_path / "student", {})
    out = tmp_path / "student"
    merged = FluxPipeline.from_pretrained(out)
    assert not any("lora" in name for name in merged.transformer.state_dict())  # a plain, merged transformer
    assert "load_lora_weights" in (out / "README.md").read_text()
    with_adapter = FluxPipeline.from_pretrained(flux_dir)
    with_adapter.load_lora_weights(out / LORA_DIR)
    inputs = {"hidden_states": torch.randn(2, 16, 16, generator=generator), "timestep": torch.tensor([0.9, 0.3]),
              "guidance": torch.tensor([GUIDANCE] * 2), "pooled_projections": torch.randn(2, 16, generator=generator),
              "encoder_hidden_states": torch.randn(2, 8, 32, generator=generator), "txt_ids": torch.zeros(8, 3),
              "img_ids": torch.zeros(16, 3), "return_dict": False}
    with torch.no_grad():
        expected = merged.transformer(**inputs)[0]
        assert (with_adapter.transformer(**inputs)[0] - expected).abs().max() < 1e-5
        assert (student(**inputs)[0] - expected).abs().max() < 1e-5
        teacher = FluxPipeline.from_pretrained(flux_dir).transformer
        assert (teacher(**inputs)[0] - expected).abs().max() > 1e-3  # the adapter matters

"""A FLUX.2 [klein] student's export: a Flux2KleinPipeline whose stock 4-step call samples as the project's student
sampler and decodes as the family's evaluation does, and a LoRA student's adapter alone, which
`Flux2KleinPipeline.load_lora_weights` loads onto the teacher to compute the merged export's velocity."""

import torch

from dmd2.config import config_from_dict
from dmd2.families.flux.klein.family import Flux2KleinFamily
from dmd2.flow_pipeline.export import LORA_DIR
from dmd2.lora import add_adapters
from dmd2.prompt_index import prompt_indices
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas

SHAPE = (1, 16, 4, 4)  # one 16 x 16 picture's latents: 4 x 4 patches of 4 channels
TOKENS = 24


def resolved(klein_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(klein_dir)}, "student": {"num_steps": 4},
                               "data": {"prompts": str(prompts), "resolution": 16, "max_sequence_length": TOKENS}})
    return Flux2KleinFamily().resolve(config, tmp_path)


def test_the_exported_pipeline_samples_as_the_students_sampler(klein_dir, tmp_path):
    from diffusers import Flux2KleinPipeline

    config, family = resolved(klein_dir, tmp_path), Flux2KleinFamily()
    family.export(family.load_model(str(klein_dir)), config, tmp_path / "student", {"scores": {"eval/x": 0.5}})
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path / "student")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.is_distilled  # the student is unguided: the stock call ignores guidance_scale
    last = []
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator, in the packed layout
    images = pipe(prompt="a photo of a cat", num_inference_steps=4, guidance_scale=4.0, height=16, width=16,
                  max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(5), output_type="pt",
                  callback_on_step_end=lambda _, i, t, kwargs: last.append(kwargs["latents"]) or {}).images
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([torch.randn(1, 16, 16).transpose(1, 2).reshape(SHAPE) for _ in range(3)])
    with torch.no_grad():
        table = family.encode_prompts(pipe, ["a photo of a cat"], "", TOKENS)
        bound = family.run_spec(config, tmp_path).family.bind({"prompts": table})
        _, x0, _ = backward_simulate(bound.velocity(pipe.transformer), noise,
                                     student_sigmas(4, config.student.grid_shift), torch.full((1,), 4),
                                     prompt_indices(torch.zeros(1)), renoise)
        torch.testing.assert_close(pipe._pack_latents(x0), last[-1], atol=1e-5, rtol=0)
        pictures = family.decode_latents(pipe.vae, x0)
    torch.testing.assert_close((pictures / 2 + 0.5).clamp(0, 1), images, atol=1e-5, rtol=0)  # the pipeline's decoding
    card = (tmp_path / "student" / "README.md").read_text()
    assert "distilled to 4 steps with DMD2" in card and 'pipe(prompt="a photo of a cat"' in card
    [picture] = family.generate(tmp_path / "student", ["a red dog"], family.generation_settings(config))
    assert picture.shape == (16, 16, 3) and picture.dtype == "uint8"  # what the logged student model serves


def test_the_exported_adapter_loads_into_the_teacher_pipeline_as_the_merged_export(klein_dir, tmp_path):
    from diffusers import Flux2KleinPipeline

    family = Flux2KleinFamily()
    student = add_adapters(family.load_model(str(klein_dir)), 2, 2.0, family.lora_targets, seed=0)
    assert any("to_qkv_mlp_proj.lora_A" in name for name, _ in student.named_parameters())  # the single blocks too
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    family.export(student, resolved(klein_dir, tmp_path), tmp_path / "student", {})
    out = tmp_path / "student"
    merged = Flux2KleinPipeline.from_pretrained(out)
    assert not any("lora" in name for name in merged.transformer.state_dict())  # a plain, merged transformer
    assert "load_lora_weights" in (out / "README.md").read_text()
    with_adapter = Flux2KleinPipeline.from_pretrained(klein_dir)
    with_adapter.load_lora_weights(out / LORA_DIR)
    inputs = {"hidden_states": torch.randn(2, 16, 16, generator=generator), "timestep": torch.tensor([0.9, 0.3]),
              "encoder_hidden_states": torch.randn(2, 8, 24, generator=generator),
              "txt_ids": torch.zeros(8, 4), "img_ids": torch.zeros(16, 4), "return_dict": False}
    with torch.no_grad():
        expected = merged.transformer(**inputs)[0]
        assert (with_adapter.transformer(**inputs)[0] - expected).abs().max() < 1e-5
        assert (student(**inputs)[0] - expected).abs().max() < 1e-5
        teacher = Flux2KleinPipeline.from_pretrained(klein_dir).transformer
        assert (teacher(**inputs)[0] - expected).abs().max() > 1e-3  # the adapter matters

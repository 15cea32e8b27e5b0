"""A Qwen-Image student's export: a QwenImagePipeline whose stock 4-step call (no true CFG) samples as the project's
student sampler, and a LoRA student's adapter alone, which `QwenImagePipeline.load_lora_weights` loads onto the
teacher to compute the merged export's velocity."""

import torch

from dmd2.config import config_from_dict
from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.families.qwen_image.prompts import encode_prompt_table
from dmd2.flow_pipeline.export import LORA_DIR
from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.lora import add_adapters
from dmd2.prompt_index import prompt_indices
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas

SHAPE = (1, 4, 4, 4)  # one 16 x 16 picture's latents
TOKENS = 64


def resolved(teacher, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(teacher)}, "student": {"num_steps": 4},
                               "data": {"prompts": str(prompts), "resolution": 16, "max_sequence_length": TOKENS}})
    return QwenImageFamily().resolve(config, tmp_path)


def test_the_exported_pipeline_samples_as_the_students_sampler(qwen_image_dir, tmp_path):
    from diffusers import QwenImagePipeline

    config, family = resolved(qwen_image_dir, tmp_path), QwenImageFamily()
    family.export(family.load_model(str(qwen_image_dir)), config, tmp_path / "student", {})
    pipe = QwenImagePipeline.from_pretrained(tmp_path / "student")
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator, in the packed layout
    latents = pipe(["a photo of a cat"], num_inference_steps=4, true_cfg_scale=1.0, height=16, width=16,
                   max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(5), output_type="latent").images
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))  # the pipeline's [B, 1, C, H, W] draw
    torch.manual_seed(99)
    renoise = torch.stack([unpack(torch.randn(pack(noise).shape), 4, 4) for _ in range(3)])
    with torch.no_grad():
        bound = family.bind({"prompts": encode_prompt_table(pipe, ["a photo of a cat"], " ", TOKENS)})
        _, x0, _ = backward_simulate(bound.velocity(pipe.transformer), noise,
                                     student_sigmas(4, config.student.grid_shift), torch.full((1,), 4),
                                     prompt_indices(torch.zeros(1)), renoise)
    assert torch.allclose(unpack(latents, 4, 4), x0, atol=1e-5)
    assert "true_cfg_scale=1.0" in (tmp_path / "student" / "README.md").read_text()


def test_the_exported_adapter_loads_into_the_teacher_pipeline_as_the_merged_export(qwen_image_dir, tmp_path):
    from diffusers import QwenImagePipeline

    family = QwenImageFamily()
    student = add_adapters(family.load_model(str(qwen_image_dir)), 2, 2.0, family.lora_targets, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    family.export(student, resolved(qwen_image_dir, tmp_path), tmp_path / "student", {})
    out = tmp_path / "student"
    merged = QwenImagePipeline.from_pretrained(out)
    assert not any("lora" in name for name in merged.transformer.state_dict())  # a plain, merged transformer
    with_adapter = QwenImagePipeline.from_pretrained(qwen_image_dir)
    with_adapter.load_lora_weights(out / LORA_DIR)
    inputs = {"hidden_states": torch.randn(2, 4, 16, generator=generator), "timestep": torch.tensor([0.9, 0.3]),
              "encoder_hidden_states": torch.randn(2, 5, 16, generator=generator), "img_shapes": [[(1, 2, 2)]] * 2,
              "return_dict": False}
    with torch.no_grad():
        expected = merged.transformer(**inputs)[0]
        assert (with_adapter.transformer(**inputs)[0] - expected).abs().max() < 1e-5
        assert (student(**inputs)[0] - expected).abs().max() < 1e-5
        teacher = QwenImagePipeline.from_pretrained(qwen_image_dir).transformer
        assert (teacher(**inputs)[0] - expected).abs().max() > 1e-3  # the adapter matters

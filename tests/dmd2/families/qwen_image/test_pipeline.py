"""The Qwen-Image teacher read from its configs: claimed, its latent shape, the time shift its own `mu` gives at a
resolution (the pipeline's), what is refused, the published model's size; its VAE normalisation in evaluation."""

import numpy as np
import pytest
import torch

from dmd2.config import ConfigError, config_from_dict
from dmd2.family import family_name
from dmd2.families.qwen_image import checks
from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.families.qwen_image.pipeline import latent_shape, teacher_shift
from dmd2.schedule import student_sigmas


def recipe(teacher, tmp_path, **data):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    return config_from_dict({"model": {"teacher": str(teacher)}, "data": {"prompts": str(prompts), **data}})


def test_a_qwen_image_pipeline_is_claimed_and_its_grid_uses_the_pipelines_mu(qwen_image_dir, qwen_image_pipe,
                                                                              tmp_path):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    assert family_name(config_from_dict({"model": {"teacher": str(qwen_image_dir)}}).model) == "qwen_image"
    assert latent_shape(str(qwen_image_dir), 32) == (4, 8, 8)  # z_dim channels; 4 px per cell (two downsamplings)
    config = QwenImageFamily().resolve(recipe(qwen_image_dir, tmp_path, resolution=64), tmp_path)
    scheduler, pipe = qwen_image_pipe.scheduler, qwen_image_pipe
    packed = pipe.prepare_latents(1, 4, 64, 64, torch.float32, "cpu", torch.Generator().manual_seed(0))
    mu = calculate_shift(packed.shape[1], scheduler.config.base_image_seq_len, scheduler.config.max_image_seq_len,
                         scheduler.config.base_shift, scheduler.config.max_shift)
    assert config.student.grid_shift == pytest.approx(np.exp(mu))
    # the pipeline's own grid also stretches to shift_terminal; without that stretch it is the student's
    scheduler.register_to_config(shift_terminal=None)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
    torch.testing.assert_close(student_sigmas(4, config.student.grid_shift), scheduler.sigmas[:-1], atol=1e-6, rtol=0)
    scheduler.register_to_config(shift_terminal=0.02)


def test_a_sequence_split_that_cannot_divide_the_image_tokens_is_refused(qwen_image_dir, tmp_path):
    """Ulysses splits the image's tokens (16 px: 2 x 2; 24 px: 3 x 3) and the 2 heads; the text is padded to split."""
    split = {"world_size": 2, "sequence_parallel": 2, "rollout_batch_size": 5}
    checks.check(recipe(qwen_image_dir, tmp_path, resolution=16).replace("train", **split))
    with pytest.raises(ConfigError, match=r"does not divide the 9 image tokens of a 24 px picture"):
        checks.check(recipe(qwen_image_dir, tmp_path, resolution=24).replace("train", **split))


def test_what_the_family_cannot_run_is_refused_naming_the_option(qwen_image_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"\[data\] resolution 20 is not a multiple of 8 .*use 16 or 24"):
        checks.check(recipe(qwen_image_dir, tmp_path, resolution=20))


def test_the_evaluation_decodes_as_the_pipeline_does(qwen_image_dir, qwen_image_pipe):
    """Per-channel statistics: z = latents * latents_std + latents_mean, QwenImagePipeline's decode."""
    family, pipe = QwenImageFamily(), qwen_image_pipe
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = pipe._pack_latents(latents[:, None], 1, 4, 4, 4)
        # the denoising loop's last callback hands the pipeline these latents to decode
        expected = pipe(prompt_embeds=torch.zeros(1, 2, 16), prompt_embeds_mask=torch.ones(1, 2, dtype=torch.long),
                        num_inference_steps=2, height=16, width=16, output_type="pt",
                        callback_on_step_end=lambda *args: {"latents": packed}).images
        got = (family.decode_latents(family.load_vae(str(qwen_image_dir)), latents) / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_qwen_image_is_planned_at_its_size_from_configs_kept_here():
    billions = sum(p.numel() for p in QwenImageFamily().model_on_meta("Qwen/Qwen-Image").parameters()) / 1e9
    assert 20.0 < billions < 20.6, billions  # "a 20B MMDiT image foundation model"
    assert latent_shape("Qwen/Qwen-Image", 1328) == (16, 166, 166)  # its 1:1 size
    assert teacher_shift("Qwen/Qwen-Image", 1024) == pytest.approx(np.exp(0.5 + (4096 - 256) * 0.4 / (8192 - 256)))

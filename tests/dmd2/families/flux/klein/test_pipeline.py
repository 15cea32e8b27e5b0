"""The FLUX.2 [klein] teacher read from its configs: claimed by the flux2_klein family, its latent shape (the
pipeline's own patchified latents), the student's grid (the pipeline's own at the run's resolution and step count),
a guidance scale a step-distilled teacher would ignore refused, and the model `dmd2 plan` builds from its config."""

import json
import shutil

import pytest
import torch

from dmd2.config import ConfigError, config_from_dict
from dmd2.family import family_name
from dmd2.families.flux.klein import checks
from dmd2.families.flux.klein.family import Flux2KleinFamily
from dmd2.families.flux.klein.pipeline import latent_shape
from dmd2.schedule import student_sigmas


def recipe(teacher, tmp_path, guidance=4.0, **sections):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    return config_from_dict({"model": {"teacher": str(teacher)}, "data": {"prompts": str(prompts)},
                             "dmd2": {"teacher_guidance_scale": guidance}, **sections})


def test_a_klein_pipeline_is_claimed_and_its_samples_are_the_pipelines_latents(klein_dir, klein_pipe, tmp_path):
    assert family_name(config_from_dict({"model": {"teacher": str(klein_dir)}}).model) == "flux2_klein"
    packed, ids = klein_pipe.prepare_latents(1, 4, 32, 24, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert klein_pipe._unpack_latents_with_ids(packed, ids).shape == (1, 16, 8, 6)  # [B, 4C, H / 4, W / 4]
    assert latent_shape(str(klein_dir), 32) == (16, 8, 8)
    with pytest.raises(ConfigError, match=r"\[data\] resolution 18 is not a multiple of 4"):
        checks.check(recipe(klein_dir, tmp_path, data={"resolution": 18}))


@pytest.mark.parametrize("resolution, steps", [(32, 4), (128, 4), (32, 1)])
def test_the_students_grid_is_the_pipelines_own_at_the_runs_resolution_and_steps(klein_dir, klein_pipe, tmp_path,
                                                                                  resolution, steps):
    config = recipe(klein_dir, tmp_path, data={"resolution": resolution}, student={"num_steps": steps})
    config = Flux2KleinFamily().resolve(config, tmp_path)
    klein_pipe(prompt="a cat", num_inference_steps=steps, height=resolution, width=resolution, guidance_scale=1.0,
               max_sequence_length=16, output_type="latent")  # sets its scheduler's sigmas with its own mu
    torch.testing.assert_close(student_sigmas(steps, config.student.grid_shift), klein_pipe.scheduler.sigmas[:-1],
                               atol=1e-6, rtol=0)
    assert config.dmd2.sigma_shift == config.student.grid_shift  # the critic's sigmas follow the same shift


def test_a_guidance_scale_a_step_distilled_teacher_ignores_is_refused(klein_dir, tmp_path):
    teacher = shutil.copytree(klein_dir, tmp_path / "distilled")
    index = teacher / "model_index.json"
    index.write_text(json.dumps(json.loads(index.read_text()) | {"is_distilled": True}))
    with pytest.raises(ConfigError, match=r"teacher_guidance_scale = 4: .* step-distilled .* set it to 1"):
        checks.check(recipe(teacher, tmp_path))
    checks.check(recipe(teacher, tmp_path, guidance=1.0))
    checks.check(recipe(klein_dir, tmp_path))  # the base model is guided


def test_dmd2_plan_builds_the_transformer_from_its_config(klein_dir):
    planned = Flux2KleinFamily().model_on_meta(str(klein_dir))
    loaded = Flux2KleinFamily().load_model(str(klein_dir))
    assert {n: p.shape for n, p in planned.named_parameters()} == {n: p.shape for n, p in loaded.named_parameters()}
    assert all(p.is_meta for p in planned.parameters())

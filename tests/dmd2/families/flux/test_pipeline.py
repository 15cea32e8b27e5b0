"""The FLUX.1 teacher read from its configs: claimed, its latent shape, the time shift its own `mu` gives at a
resolution (the student's grid at two resolutions is the pipeline's), what is refused, the published model's size."""

import json
import shutil

import numpy as np
import pytest
import torch

from dmd2.config import ConfigError, config_from_dict, load_recipe
from dmd2.family import family_name
from dmd2.families.flux import checks
from dmd2.families.flux.family import FluxFamily
from dmd2.families.flux.pipeline import latent_shape, teacher_shift
from dmd2.schedule import student_sigmas
from tests.dmd2.families.flux.tiny_pipeline import LATENT_CHANNELS


def recipe(teacher, tmp_path, **data):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    return config_from_dict({"model": {"teacher": str(teacher)}, "data": {"prompts": str(prompts), **data}})


def test_a_flux_pipeline_is_claimed_and_its_latents_are_unpacked_cells(flux_dir):
    assert family_name(config_from_dict({"model": {"teacher": str(flux_dir)}}).model) == "flux"
    assert latent_shape(str(flux_dir), 32) == (LATENT_CHANNELS, 16, 16)  # the VAE's cells; packing is the model's


def test_the_students_grid_at_two_resolutions_uses_the_mu_the_pipeline_itself_uses(flux_dir, flux_pipe, tmp_path):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = flux_pipe.scheduler
    grids = {}
    for resolution in (32, 128):
        config = FluxFamily().resolve(recipe(flux_dir, tmp_path, resolution=resolution), tmp_path)
        # FluxPipeline.__call__: image_seq_len is the packed latents' length, mu from the scheduler config
        packed, _ = flux_pipe.prepare_latents(1, LATENT_CHANNELS, resolution, resolution, torch.float32, "cpu",
                                              torch.Generator().manual_seed(0))
        mu = calculate_shift(packed.shape[1], scheduler.config.base_image_seq_len, scheduler.config.max_image_seq_len,
                             scheduler.config.base_shift, scheduler.config.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
        grids[resolution] = student_sigmas(4, config.student.grid_shift)
        torch.testing.assert_close(grids[resolution], scheduler.sigmas[:-1], atol=1e-6, rtol=0)
        assert config.dmd2.sigma_shift == config.student.grid_shift  # the critic's sigmas follow the same shift
    assert (grids[128] - grids[32])[1:].min() > 1e-3  # more tokens, more shift: the grids differ


def test_a_fixed_shift_scheduler_gives_its_shift(flux_dir, tmp_path):
    teacher = shutil.copytree(flux_dir, tmp_path / "teacher")
    path = teacher / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"use_dynamic_shifting": False, "shift": 2.0}))
    assert teacher_shift(str(teacher), 32) == 2.0 and teacher_shift(str(teacher), 128) == 2.0


@pytest.mark.parametrize("data, message", [
    ({"resolution": 18}, r"\[data\] resolution 18 is not a multiple of 4 .*use 16 or 20"),
    ({"resolution": 16, "images": "x"}, r"\[data\] images / \[dmd2\] critic_gan_weight .*not read by the flux family"),
    ({"resolution": 16, "frames": 5}, r"\[data\] frames: not read by the flux family"),
])
def test_what_the_family_cannot_run_is_refused_naming_the_option(flux_dir, tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        checks.check(recipe(flux_dir, tmp_path, **data))


def test_a_sequence_split_that_cannot_divide_a_sample_is_refused_naming_what(flux_dir, tmp_path):
    """Ulysses splits the image's 16 tokens (16 px), the text's and the 2 heads over `[train] sequence_parallel`."""
    config = recipe(flux_dir, tmp_path, resolution=16, max_sequence_length=6)
    split = {"world_size": 2, "sequence_parallel": 2, "rollout_batch_size": 5}
    checks.check(config.replace("train", **split))
    with pytest.raises(ConfigError, match=r"sequence_parallel = 4 does not divide the 2 attention heads"):
        checks.check(config.replace("train", **(split | {"world_size": 4, "sequence_parallel": 4})))
    with pytest.raises(ConfigError, match=r"does not divide the 5 text tokens \(\[data\] max_sequence_length\)"):
        checks.check(config.replace("train", **split).replace("data", max_sequence_length=5))


def test_the_plan_of_the_published_teacher_refuses_a_split_it_cannot_take():
    """`dmd2 plan` reads no prompt file and fetches nothing: FLUX.1 [dev]'s split is checked on the configs kept here."""
    from flows.recipe import RECIPES

    config = load_recipe(RECIPES / "flux1-dev-4step.toml", {"train": {"sequence_parallel": 8, "rollout_batch_size": 10},
                                                            "data": {"max_sequence_length": 500}})
    with pytest.raises(ConfigError, match=r"does not divide the 500 text tokens \(\[data\] max_sequence_length\)"):
        FluxFamily().plan_spec(config)
    assert FluxFamily().plan_spec(config.replace("data", max_sequence_length=512)).sample_shape == (16, 128, 128)


def test_flux1_dev_is_planned_at_its_size_from_configs_kept_here():
    billions = sum(p.numel() for p in FluxFamily().model_on_meta("black-forest-labs/FLUX.1-dev").parameters()) / 1e9
    assert 11.8 < billions < 12.0, billions  # "a 12 billion parameter rectified flow transformer"
    assert latent_shape("black-forest-labs/FLUX.1-dev", 1024) == (16, 128, 128)
    assert teacher_shift("black-forest-labs/FLUX.1-dev", 1024) == pytest.approx(np.exp(1.15))  # 4096 tokens: max_shift

"""dmd2/families/sd3/pipeline.py: checking an SD3 teacher directory from its JSON configs."""

import json
import shutil

import pytest
import torch

from dmd2.families.sd3.pipeline import (
    check_flow_matching,
    check_sd3_pipeline,
    is_sd3_pipeline,
    latent_shape,
    load_transformer,
    read_pipeline_index,
    shift_of,
)
from tests.dmd2.families.sd3.tiny_pipeline import SHIFT


def with_scheduler(tmp_path, teacher, **changes):
    """A copy of the teacher's scheduler config with `changes`, in a pipeline-shaped directory."""
    config = json.loads((teacher / "scheduler" / "scheduler_config.json").read_text())
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


def test_the_tiny_pipeline_loads_back(sd3_pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    assert isinstance(sd3_pipe.transformer, SD3Transformer2DModel)
    assert isinstance(sd3_pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert sd3_pipe.text_encoder_3 is not None and sd3_pipe.tokenizer_3 is not None


def test_is_sd3_pipeline(sd3_dir, sd_dir, tmp_path):
    assert is_sd3_pipeline(sd3_dir)
    assert not is_sd3_pipeline(sd_dir)
    assert not is_sd3_pipeline(tmp_path / "missing")
    (tmp_path / "model_index.json").write_text("{not json")
    assert not is_sd3_pipeline(tmp_path)


def test_read_pipeline_index_names_the_file(sd3_dir, tmp_path):
    assert read_pipeline_index(sd3_dir)["_class_name"] == "StableDiffusion3Pipeline"
    with pytest.raises(ValueError, match=r"model_index\.json does not exist"):
        read_pipeline_index(tmp_path)
    (tmp_path / "model_index.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"model_index\.json is not readable JSON"):
        read_pipeline_index(tmp_path)


def test_check_sd3_pipeline_refuses_other_pipelines(sd_dir):
    with pytest.raises(ValueError, match=r"StableDiffusionPipeline.*not 'StableDiffusion3Pipeline'"):
        check_sd3_pipeline(sd_dir)


def test_check_flow_matching_accepts_the_sd3_scheduler(sd3_dir):
    config = check_flow_matching(sd3_dir)
    assert config["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert shift_of(sd3_dir) == SHIFT


def test_check_flow_matching_refuses_a_ddpm_teacher(sd_dir):
    with pytest.raises(ValueError) as error:
        check_flow_matching(sd_dir)
    message = str(error.value)
    assert str(sd_dir) in message and "DDPMScheduler" in message and "FlowMatchEulerDiscreteScheduler" in message


@pytest.mark.parametrize("changes, needle", [
    ({"use_dynamic_shifting": True}, "use_dynamic_shifting"),
    ({"prediction_type": "epsilon"}, "prediction_type 'epsilon'"),
    ({"num_train_timesteps": 100}, "num_train_timesteps 100"),
])
def test_check_flow_matching_refuses_what_breaks_a_fixed_velocity_grid(sd3_dir, tmp_path, changes, needle):
    with pytest.raises(ValueError, match=needle):
        check_flow_matching(with_scheduler(tmp_path, sd3_dir, **changes))


def test_check_flow_matching_accepts_a_flow_prediction_key(sd3_dir, tmp_path):
    assert check_flow_matching(with_scheduler(tmp_path, sd3_dir, prediction_type="flow_prediction"))


def test_check_flow_matching_names_a_missing_scheduler(tmp_path):
    with pytest.raises(ValueError, match=r"scheduler_config\.json does not exist"):
        check_flow_matching(tmp_path)


def test_latent_shape(sd3_dir):
    # vae: 2 blocks -> scale factor 2; 4 latent channels; patch size 2 -> multiples of 4
    assert latent_shape(sd3_dir, 16) == (4, 8, 8)
    assert latent_shape(sd3_dir, 20) == (4, 10, 10)


def test_latent_shape_refuses_a_resolution_off_the_patch_grid(sd3_dir):
    with pytest.raises(ValueError) as error:
        latent_shape(sd3_dir, 18)
    message = str(error.value)
    assert "[data] resolution 18" in message and "16 or 20" in message and "multiple of 4" in message


def test_latent_shape_refuses_mismatched_components(sd3_dir, tmp_path):
    shutil.copytree(sd3_dir / "vae", tmp_path / "vae")
    config = json.loads((sd3_dir / "transformer" / "config.json").read_text())
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 16}))
    with pytest.raises(ValueError, match="in_channels 16 but vae/config.json has latent_channels 4"):
        latent_shape(tmp_path, 16)


def test_load_transformer(sd3_dir, sd3_pipe):
    transformer = load_transformer(sd3_dir)
    assert type(transformer).__name__ == "SD3Transformer2DModel"
    for (name, p), q in zip(transformer.state_dict().items(), sd3_pipe.transformer.state_dict().values()):
        assert torch.equal(p, q), name
    assert load_transformer(sd3_dir, dtype=torch.bfloat16).dtype == torch.bfloat16

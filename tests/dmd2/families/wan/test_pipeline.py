"""The Wan teacher read from its configs: claimed, its flow shift, its latent shape, and what is refused."""

import pytest

from dmd2.config import ConfigError, config_from_dict, load_recipe
from dmd2.family import checked_family, family_name
from dmd2.families.wan import checks
from dmd2.families.wan.family import WanFamily
from dmd2.families.wan.pipeline import experts, flow_shift_of, latent_shape
from tests.dmd2.families.wan.tiny_pipeline import BOUNDARY_RATIO, FLOW_SHIFT, LATENT_CHANNELS


def test_a_wan_pipeline_is_claimed_and_read_from_its_configs(wan_dir, wan22_dir):
    assert family_name(config_from_dict({"model": {"teacher": str(wan_dir)}}).model) == "wan"
    assert flow_shift_of(wan_dir) == FLOW_SHIFT  # UniPC's flow_shift
    assert experts(wan_dir) == (["transformer"], None)
    assert experts(wan22_dir) == (["transformer", "transformer_2"], BOUNDARY_RATIO)
    # [C, (F - 1) / 4 + 1, H / 8, W / 8], non-square
    assert latent_shape(wan_dir, 81, 480, 832) == (LATENT_CHANNELS, 21, 60, 104)
    assert latent_shape(wan_dir, 5, 16, 32) == (LATENT_CHANNELS, 2, 2, 4)


@pytest.mark.parametrize("data, message", [
    ({"frames": 4}, r"\[data\] frames 4 is not 4 k \+ 1.*use 1 or 5"),
    ({"frames": 5, "height": 24, "width": 16}, r"\[data\] height 24 is not a multiple of 16.*use 16 or 32"),
])
def test_video_sizes_the_vae_cannot_take_are_refused_naming_the_option(wan_dir, tmp_path, data, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(wan_dir)}, "data": {"prompts": str(prompts), **data}})
    with pytest.raises(ConfigError, match=message):
        checks.check(config)


def test_a_scheduler_that_is_not_flow_prediction_is_refused(wan_dir, tmp_path):
    import json
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(wan_dir, teacher)
    path = teacher / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"prediction_type": "epsilon"}))
    with pytest.raises(ValueError, match="flow prediction"):
        flow_shift_of(teacher)


def test_options_the_wan_family_does_not_read_are_refused(wan_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(wan_dir)}, "eval": {"clip_model": "openai/clip"},
                               "data": {"prompts": str(prompts), "frames": 5, "resolution": 16}})
    with pytest.raises(ConfigError, match=r"\[eval\] clip_model: not read by the wan family"):
        checks.check(config)


@pytest.mark.parametrize("train, data, message", [
    ({"world_size": 4, "sequence_parallel": 4}, {"height": 32, "width": 32},
     r"sequence_parallel = 4 does not divide the 2 attention heads"),
    ({"world_size": 2, "sequence_parallel": 2}, {"height": 16, "width": 48},
     r"sequence_parallel = 2 does not divide the 9 tokens of a 9 x 16 x 48 video \(3 latent frames x 1 x 3 patches\)"),
])
def test_a_sequence_split_the_teacher_cannot_take_is_refused(wan_dir, tmp_path, train, data, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"teacher": str(wan_dir)}, "train": {"rollout_batch_size": 10, **train},
                               "data": {"prompts": str(prompts), "frames": 9, **data}})
    with pytest.raises(ConfigError, match=message):
        checked_family(config)
    checked_family(config.replace("data", height=32, width=32).replace("train", world_size=2, sequence_parallel=2))


def test_the_14b_recipe_splits_its_720p_videos_over_the_node_and_the_13b_teacher_could_not(tmp_path):
    from flows.recipe import RECIPES

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    recipe = RECIPES / "wan21-t2v-14b-4step.toml"
    config = load_recipe(recipe, {"data": {"prompts": str(prompts)}})
    assert (config.train.world_size, config.train.sequence_parallel, config.critic_batch_size) == (8, 8, 1)
    checked_family(config)  # 40 heads, 21 x 45 x 80 tokens: both split over 8
    with pytest.raises(ConfigError, match="does not divide the 12 attention heads"):
        checked_family(config.replace("model", teacher="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"))
    # `dmd2 plan` reads no prompt file, and refuses the split as the run would, before rehearsing anything
    with pytest.raises(ConfigError, match="does not divide the 12 attention heads"):
        WanFamily().plan_spec(config.replace("model", teacher="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"))


def test_families_whose_model_cannot_split_tokens_refuse_sequence_parallel():
    config = config_from_dict({"model": {"teacher": "builtin:digits"},
                               "train": {"world_size": 2, "sequence_parallel": 2, "rollout_batch_size": 10}})
    with pytest.raises(ConfigError, match=r"sequence_parallel = 2: not read by the digits family, its model cannot "
                                          r"split its tokens over ranks \(families that read it: flux, qwen_image, "
                                          r"wan\); set it to 1"):
        checked_family(config)


@pytest.mark.parametrize("teacher, student, message", [
    ("wan22", {"expert": "transformer_3"}, r"\[student\] expert = 'transformer_3' is not one of Wan 2.2's experts"),
    ("wan21", {"expert": "transformer"}, r"has one transformer \(Wan 2.1\), nothing to choose"),
    ("wan22", {"expert": "transformer", "lora_rank": 4}, r"a LoRA student of one expert is not supported yet"),
])
def test_a_student_expert_the_teacher_cannot_give_is_refused(wan_dir, wan22_dir, tmp_path, teacher, student, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    path = {"wan21": wan_dir, "wan22": wan22_dir}[teacher]
    config = config_from_dict({"model": {"teacher": str(path)}, "student": student,
                               "data": {"prompts": str(prompts), "frames": 5, "resolution": 16}})
    with pytest.raises(ConfigError, match=message):
        checked_family(config)
    with pytest.raises(ConfigError, match=r"\[student\] expert = 'transformer': not read by the digits family"):
        checked_family(config_from_dict({"model": {"teacher": "builtin:digits"}, "student": {"expert": "transformer"}}))


def test_the_picture_families_refuse_video_options(tmp_path):
    from dmd2.families.digits import checks as digits_checks
    from dmd2.families.sd3 import checks as sd3_checks

    with pytest.raises(ConfigError, match=r"\[data\] frames: read only by text-to-image families"):
        digits_checks.check(config_from_dict({"model": {"teacher": "builtin:digits"}, "data": {"frames": 5}}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    config = config_from_dict({"model": {"family": "sd3", "teacher": "owner/some-sd3"},
                               "data": {"prompts": str(prompts), "height": 16, "width": 32}})
    with pytest.raises(ConfigError, match=r"\[data\] height, \[data\] width: the sd3 family makes square pictures"):
        sd3_checks.check(config)


def test_the_published_teachers_are_planned_at_their_size_from_configs_kept_here():
    from dmd2.families.wan.family import WanFamily

    billions = {hub_id: sum(p.numel() for p in WanFamily().model_on_meta(hub_id).parameters()) / 1e9
                for hub_id in ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers")}
    assert 1.3 <= billions["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"] < 1.5, billions  # the model names say 1.3B, 14B
    assert 14.0 <= billions["Wan-AI/Wan2.1-T2V-14B-Diffusers"] < 14.5, billions
    assert latent_shape("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 81, 480, 832) == (16, 21, 60, 104)

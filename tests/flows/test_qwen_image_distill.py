"""The qwen_image family end to end on a tiny QwenImagePipeline, through the CLI a user runs (`dmd2 distill --recipe
recipes/qwen-image-4step.toml --set model.teacher=DIR ...`; what the packed-latent families share is in
packed_family_runs.py)."""

import pytest

from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.families.qwen_image.prompts import encode_prompt_table
from tests.dmd2.families.qwen_image.tiny_pipeline import build_tiny_qwen_image_pipeline
from tests.flows.packed_family_runs import (assert_evaluated_at_each_rollout,
                                            assert_the_export_samples_as_the_students_sampler,
                                            assert_the_registered_student_generates_pictures, distill_tiny_pipeline)

LATENT = (1, 4, 4, 4)  # one 16 x 16 picture
TOKENS = 64


@pytest.fixture(scope="module")
def qwen_run(prefect_server, shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenrun")
    teacher = build_tiny_qwen_image_pipeline(tmp / "teacher")
    return distill_tiny_pipeline(tmp, teacher, "qwen-image-4step.toml", "qwen-a", QwenImageFamily(), TOKENS)


@pytest.mark.slow
def test_the_cli_distills_and_the_exported_pipeline_samples_as_the_students_sampler(qwen_run):
    from diffusers import QwenImagePipeline

    assert_evaluated_at_each_rollout(qwen_run)

    def bind(pipe, prompt):
        return QwenImageFamily().bind({"prompts": encode_prompt_table(pipe, prompt, " ", TOKENS)})

    assert_the_export_samples_as_the_students_sampler(QwenImagePipeline.from_pretrained(qwen_run["student_dir"]), bind,
                                                      qwen_run, LATENT, true_cfg_scale=1.0, max_sequence_length=TOKENS)


@pytest.mark.slow
def test_the_logged_student_model_generates_pictures(qwen_run, monkeypatch):
    assert_the_registered_student_generates_pictures(qwen_run, "qwen-a", monkeypatch)

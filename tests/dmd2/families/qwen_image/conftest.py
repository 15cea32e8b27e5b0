"""A tiny Qwen-Image pipeline, built and loaded back once per test session."""

import pytest

from tests.dmd2.families.qwen_image.tiny_pipeline import build_tiny_qwen_image_pipeline


@pytest.fixture(scope="session")
def qwen_image_dir(tmp_path_factory):
    return build_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("qwen_image") / "teacher")


@pytest.fixture(scope="session")
def qwen_image_pipe(qwen_image_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_image_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe

"""Tiny SD3 and SD 1.x pipelines, built once per test session (building and importing take seconds)."""

import pytest

from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline, build_tiny_sd_pipeline


@pytest.fixture(scope="session")
def sd3_dir(tmp_path_factory):
    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "teacher")


@pytest.fixture(scope="session")
def sd_dir(tmp_path_factory):
    return build_tiny_sd_pipeline(tmp_path_factory.mktemp("sd") / "teacher")


@pytest.fixture(scope="session")
def sd3_pipe(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe

"""Tiny Wan pipelines (one expert, and Wan 2.2 A14B's two), built and loaded back once per test session."""

import pytest

from tests.dmd2.families.wan.tiny_pipeline import build_tiny_wan_pipeline


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory):
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan") / "teacher")


@pytest.fixture(scope="session")
def wan_pipe(wan_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory):
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan22") / "teacher", experts=2)

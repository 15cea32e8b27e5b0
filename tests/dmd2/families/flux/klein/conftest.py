"""A tiny FLUX.2 [klein] base pipeline, built and loaded back once per test session."""

import pytest

from tests.dmd2.families.flux.klein.tiny_pipeline import build_tiny_klein_pipeline


@pytest.fixture(scope="session")
def klein_dir(tmp_path_factory):
    return build_tiny_klein_pipeline(tmp_path_factory.mktemp("klein") / "teacher")


@pytest.fixture(scope="session")
def klein_pipe(klein_dir):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe

"""A tiny FLUX.1 [dev] pipeline, built and loaded back once per test session."""

import pytest

from tests.dmd2.families.flux.tiny_pipeline import build_tiny_flux_pipeline


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    return build_tiny_flux_pipeline(tmp_path_factory.mktemp("flux") / "teacher")


@pytest.fixture(scope="session")
def flux_pipe(flux_dir):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe

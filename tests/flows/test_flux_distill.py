"""The flux family end to end on a tiny FluxPipeline, through the CLI a user runs (`dmd2 distill --recipe
recipes/flux1-dev-4step.toml --set model.teacher=DIR ...`; what the packed-latent families share is in
packed_family_runs.py)."""

import pytest

from dmd2.families.flux.family import FluxFamily
from tests.dmd2.families.flux.tiny_pipeline import build_tiny_flux_pipeline
from tests.flows.packed_family_runs import (assert_evaluated_at_each_rollout,
                                            assert_the_export_samples_as_the_students_sampler,
                                            assert_the_registered_student_generates_pictures, distill_tiny_pipeline)

LATENT = (1, 4, 8, 8)  # one 16 x 16 picture
TOKENS = 8


@pytest.fixture(scope="module")
def flux_run(prefect_server, shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fluxrun")
    teacher = build_tiny_flux_pipeline(tmp / "teacher")
    return distill_tiny_pipeline(tmp, teacher, "flux1-dev-4step.toml", "flux-a", FluxFamily(), TOKENS)


@pytest.mark.slow
def test_the_cli_distills_and_the_exported_pipeline_samples_as_the_students_sampler(flux_run):
    from diffusers import FluxPipeline

    assert_evaluated_at_each_rollout(flux_run)
    grid_shift, guidance = flux_run["config"].student.grid_shift, flux_run["config"].dmd2.teacher_guidance_scale
    assert f"(shift {grid_shift})" in (flux_run["student_dir"] / "README.md").read_text()  # e^mu of 16 px's 16 tokens

    def bind(pipe, prompt):
        embeds, pooled, _ = pipe.encode_prompt(prompt, max_sequence_length=TOKENS)
        return FluxFamily(guidance=guidance).bind({"prompts": {
            "prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": embeds,
            "negative_pooled_prompt_embeds": pooled}})

    assert_the_export_samples_as_the_students_sampler(FluxPipeline.from_pretrained(flux_run["student_dir"]), bind,
                                                      flux_run, LATENT, guidance_scale=guidance,
                                                      max_sequence_length=TOKENS)


@pytest.mark.slow
def test_the_logged_student_model_generates_pictures(flux_run, monkeypatch):
    assert_the_registered_student_generates_pictures(flux_run, "flux-a", monkeypatch)

"""The flux2_klein family end to end on a tiny Flux2KleinPipeline, through the CLI a user runs: one rollout of
`dmd2 distill --recipe recipes/flux1-dev-4step.toml --set model.family=flux2_klein --set model.teacher=DIR ...` (no
klein recipe ships: no published klein config is grounded here), as small as a run goes. That its export samples as
the student's sampler is tests/dmd2/families/flux/klein/test_export.py's; here: the run trains, evaluates and exports
a step-distilled Flux2KleinPipeline on the grid of the pipeline's own shift at 16 px and 4 steps."""

import contextlib
import io
import math

import pytest
import torch
from mlflow import MlflowClient

from dmd2.families.flux.klein.pipeline import empirical_mu
from flows.cli import main
from flows.recipe import RECIPES
from tests.dmd2.families.flux.klein.tiny_pipeline import build_tiny_klein_pipeline
from tests.flows.packed_family_runs import PROMPTS
from tests.tracking_db import tracking_uri_in

SMALL = ["model.family=flux2_klein", "data.resolution=16", "data.max_sequence_length=24", "train.world_size=1",
         "train.rollout_batch_size=2", "dmd2.critic_steps_per_rollout=1", "eval.reference_steps=2",
         "eval.samples_per_prompt=2", 'eval.prompts=["a photo of a cat"]', "optim.lr=1e-2",
         "registry.register=false"]


@pytest.mark.slow
def test_the_cli_distills_a_klein_pipeline_into_a_step_distilled_export(prefect_server, shared_ray, tmp_path):
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    teacher = build_tiny_klein_pipeline(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    uri = tracking_uri_in(tmp_path)
    overrides = [f"model.teacher={teacher}", f"data.prompts={prompts}", *SMALL]
    args = ["distill", "--recipe", str(RECIPES / "flux1-dev-4step.toml"), "--run-id", "klein-a", "--rollouts", "1",
            "--store", (tmp_path / "store").as_uri(), "--tracking-uri", uri, "--output-dir", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + [item for s in overrides for item in ("--set", s)]) == 0
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                               filter_string="tags.`dmd2.run_id` = 'klein-a'")
    for metric in ("train/loss", "train/critic-loss", "eval/distance_teacher"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [0], metric
    student = Flux2KleinPipeline.from_pretrained(tmp_path / "out" / "klein-a" / "student")
    assert student.config.is_distilled
    # 16 px: 4 x 4 patches, 16 tokens; the pipeline's own mu at 16 tokens and 4 steps
    assert student.scheduler.config.shift == pytest.approx(math.exp(empirical_mu(16, 4)))
    trained = dict(student.transformer.named_parameters())
    moved = [name for name, p in Flux2Transformer2DModel.from_pretrained(teacher, subfolder="transformer")
             .named_parameters() if not torch.equal(p, trained[name])]
    assert moved  # the student is not the teacher

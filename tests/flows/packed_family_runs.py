"""What the end-to-end tests of the packed-latent families (flux, qwen_image) share: a two-rollout run of a tiny
pipeline, built from configs and saved as a user's would be, through the CLI a user runs (`dmd2 distill --recipe
recipes/<recipe> --set model.teacher=DIR ...`: Prefect's in-process server, a local Ray, the store on file://,
MLflow on sqlite), and the check that the student it registers generates pictures."""

import contextlib
import io
from pathlib import Path

import torch
from mlflow import MlflowClient

from dmd2.config import load_recipe, parse_overrides
from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.prompt_index import prompt_indices
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas
from flows.cli import main
from flows.recipe import RECIPES
from tests.tracking_db import tracking_uri_in

PROMPTS = ["a photo of a cat", "a red dog", "the blue sign", "a cat on the sign"]
SMALL = ["data.resolution=16", "train.world_size=1", "train.rollout_batch_size=4", "dmd2.critic_steps_per_rollout=2",
         "train.save_interval=2", "train.eval_interval=1", "eval.reference_steps=4", "optim.lr=1e-3",
         "optim.critic_lr=2e-3", 'eval.prompts=["a photo of a cat", "a red dog"]']


def distill_tiny_pipeline(tmp: Path, teacher: Path, recipe: str, run_id: str, family, tokens: int) -> dict:
    """Distill `teacher` for two rollouts with `recipe`, made small; the MLflow client and run, the exported
    student's folder and the run's config as `family` resolves it."""
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    uri = tracking_uri_in(tmp)
    overrides = [f"model.teacher={teacher}", f"data.prompts={prompts}", f"data.max_sequence_length={tokens}", *SMALL]
    args = ["distill", "--recipe", str(RECIPES / recipe), "--run-id", run_id, "--rollouts", "2",
            "--store", (tmp / "store").as_uri(), "--tracking-uri", uri, "--output-dir", str(tmp / "out"),
            "--cache-dir", str(tmp / "cache")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + [item for s in overrides for item in ("--set", s)]) == 0
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                               filter_string=f"tags.`dmd2.run_id` = '{run_id}'")
    config = family.resolve(load_recipe(RECIPES / recipe, parse_overrides(overrides)), tmp)
    return {"client": client, "mlflow_run_id": run.info.run_id, "student_dir": tmp / "out" / run_id / "student",
            "config": config}


def assert_evaluated_at_each_rollout(run: dict) -> None:
    for metric in ("eval/distance_teacher", "eval/pixel_kid_teacher", "eval/diversity_ratio"):
        assert [m.step for m in run["client"].get_metric_history(run["mlflow_run_id"], metric)] == [0, 1]


def assert_the_export_samples_as_the_students_sampler(pipe, bind, run: dict, latent: tuple, **call) -> None:
    """The exported pipeline's 4-step latents for the first prompt equal the student's own sampler's (the family
    bound by `bind(pipe, prompt)` to the pipeline's prompt embeddings), from the same noise and re-noising."""
    pipe.set_progress_bar_config(disable=True)
    prompt, side = ["a photo of a cat"], latent[-1]
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator, in the packed layout
    latents = pipe(prompt, num_inference_steps=4, height=16, width=16, generator=torch.Generator().manual_seed(5),
                   output_type="latent", **call).images
    noise = torch.randn(latent, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([unpack(torch.randn(pack(noise).shape), side, side) for _ in range(3)])
    with torch.no_grad():
        _, x0, _ = backward_simulate(bind(pipe, prompt).velocity(pipe.transformer), noise,
                                     student_sigmas(4, run["config"].student.grid_shift), torch.full((1,), 4),
                                     prompt_indices(torch.zeros(1)), renoise)
    assert torch.allclose(unpack(latents, side, side), x0, atol=1e-5)


def assert_the_registered_student_generates_pictures(run: dict, registered: str, monkeypatch) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", run["client"].tracking_uri)  # where `models:/` resolves
    model = mlflow.pyfunc.load_model(f"models:/{registered}/latest")  # the registered model is named after the run id
    pictures = model.predict(["a red dog"], params={"seed": 3})
    assert pictures.shape == (1, 16, 16, 3) and pictures.dtype == "uint8"

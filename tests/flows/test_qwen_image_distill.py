"""The qwen_image family end to end on a tiny QwenImagePipeline built from configs and saved as a user's would be,
through the same CLI a user runs: `dmd2 distill --recipe recipes/qwen-image-4step.toml --set model.teacher=DIR ...`.

Real Prefect (in-process server), a local Ray, the store on file://, MLflow on sqlite.
"""

import contextlib
import io

import pytest
import torch
from mlflow import MlflowClient

from dmd2.config import load_recipe, parse_overrides
from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.families.qwen_image.prompts import encode_prompt_table
from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.prompt_index import prompt_indices
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas
from flows.cli import main
from flows.recipe import RECIPES
from tests.dmd2.families.qwen_image.tiny_pipeline import build_tiny_qwen_image_pipeline

PROMPTS = ["a photo of a cat", "a red dog", "the blue sign", "a cat on the sign"]
LATENT = (1, 4, 4, 4)  # one 16 x 16 picture
TOKENS = 64
SMALL = ["data.resolution=16", f"data.max_sequence_length={TOKENS}", "train.world_size=1",
         "train.rollout_batch_size=4", "dmd2.critic_steps_per_rollout=2", "train.save_interval=2",
         "train.eval_interval=1", "eval.reference_steps=4", "optim.lr=1e-3", "optim.critic_lr=2e-3",
         'eval.prompts=["a photo of a cat", "a red dog"]']


@pytest.fixture(scope="module")
def qwen_run(prefect_server, shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenrun")
    teacher = build_tiny_qwen_image_pipeline(tmp / "teacher")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    overrides = [f"model.teacher={teacher}", f"data.prompts={prompts}", *SMALL]
    args = ["distill", "--recipe", str(RECIPES / "qwen-image-4step.toml"), "--run-id", "qwen-a", "--rollouts", "2",
            "--store", (tmp / "store").as_uri(), "--tracking-uri", uri, "--output-dir", str(tmp / "out"),
            "--cache-dir", str(tmp / "cache")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args + [item for s in overrides for item in ("--set", s)]) == 0
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                               filter_string="tags.`dmd2.run_id` = 'qwen-a'")
    config = QwenImageFamily().resolve(load_recipe(RECIPES / "qwen-image-4step.toml", parse_overrides(overrides)), tmp)
    return {"client": client, "mlflow_run_id": run.info.run_id, "student_dir": tmp / "out" / "qwen-a" / "student",
            "config": config}


@pytest.mark.slow
def test_the_cli_distills_and_the_exported_pipeline_samples_as_the_students_sampler(qwen_run):
    from diffusers import QwenImagePipeline

    client, run_id, config = qwen_run["client"], qwen_run["mlflow_run_id"], qwen_run["config"]
    for metric in ("eval/distance_teacher", "eval/pixel_kid_teacher", "eval/diversity_ratio"):
        assert [m.step for m in client.get_metric_history(run_id, metric)] == [0, 1]
    pipe = QwenImagePipeline.from_pretrained(qwen_run["student_dir"])
    pipe.set_progress_bar_config(disable=True)
    prompt = ["a photo of a cat"]
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator, in the packed layout
    latents = pipe(prompt, num_inference_steps=4, true_cfg_scale=1.0, height=16, width=16, max_sequence_length=TOKENS,
                   generator=torch.Generator().manual_seed(5), output_type="latent").images
    noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([unpack(torch.randn(pack(noise).shape), 4, 4) for _ in range(3)])
    with torch.no_grad():
        family = QwenImageFamily().bind({"prompts": encode_prompt_table(pipe, prompt, " ", TOKENS)})
        _, x0, _ = backward_simulate(family.velocity(pipe.transformer), noise,
                                     student_sigmas(4, config.student.grid_shift), torch.full((1,), 4),
                                     prompt_indices(torch.zeros(1)), renoise)
    assert torch.allclose(unpack(latents, 4, 4), x0, atol=1e-5)


@pytest.mark.slow
def test_the_logged_student_model_generates_pictures(qwen_run, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", qwen_run["client"].tracking_uri)  # where `models:/` resolves
    model = mlflow.pyfunc.load_model("models:/qwen-a/latest")  # the registered model is named after the run id
    pictures = model.predict(["a red dog"], params={"seed": 3})
    assert pictures.shape == (1, 16, 16, 3) and pictures.dtype == "uint8"

"""The Wan family end to end on a tiny WanPipeline built from configs and saved as a user's would be, through the
same CLI a user runs: `dmd2 distill --recipe recipes/wan21-t2v-1.3b-4step.toml --set model.teacher=DIR ...`.

Real Prefect (in-process server), a local Ray, the store on file://, MLflow on sqlite.
"""

import contextlib
import io
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from dmd2.model import DiffusersVelocity
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas
from flows.cli import main
from flows.recipe import RECIPES
from tests.dmd2.families.wan.tiny_pipeline import FLOW_SHIFT, build_tiny_wan_pipeline
from tests.tracking_db import tracking_uri_in

PROMPTS = ["a cat runs on the grass", "a red ball", "the dog jumps", "a blue ball on the grass"]
LATENT = (4, 2, 2, 2)  # 5 frames of 16 x 16 px
TOKENS = 8
SMALL = ["data.frames=5", "data.height=16", "data.width=16", f"data.max_sequence_length={TOKENS}",
         "train.world_size=1", "train.rollout_batch_size=4", "dmd2.critic_steps_per_rollout=2", "train.save_interval=2",
         "train.eval_interval=1", "eval.reference_steps=4", "optim.lr=1e-3", "optim.critic_lr=2e-3",
         'eval.prompts=["a cat runs on the grass", "a red ball"]']


@pytest.fixture(scope="module")
def wan_run(prefect_server, shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wanrun")
    teacher = build_tiny_wan_pipeline(tmp / "teacher")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    uri = tracking_uri_in(tmp)
    args = ["distill", "--recipe", str(RECIPES / "wan21-t2v-1.3b-4step.toml"), "--run-id", "wan-a", "--rollouts", "2",
            "--store", (tmp / "store").as_uri(), "--tracking-uri", uri, "--output-dir", str(tmp / "out"),
            "--cache-dir", str(tmp / "cache"), "--set", f"model.teacher={teacher}", "--set", f"data.prompts={prompts}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args + [item for s in SMALL for item in ("--set", s)]) == 0
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                               filter_string="tags.`dmd2.run_id` = 'wan-a'")
    return {"client": client, "mlflow_run_id": run.info.run_id, "student_dir": tmp / "out" / "wan-a" / "student",
            "out": tmp / "out" / "wan-a", "printed": printed.getvalue()}


def test_mlflow_holds_mp4s_of_the_teacher_and_of_the_student_at_every_evaluation(wan_run):
    import av

    client, run_id = wan_run["client"], wan_run["mlflow_run_id"]
    teacher = [a.path for a in client.list_artifacts(run_id, "videos/teacher")]
    student = [a.path for a in client.list_artifacts(run_id, "videos/samples")]
    assert teacher == ["videos/teacher/step-0.mp4"]
    assert sorted(student) == [f"videos/samples/step-{step}.mp4" for step in (0, 1)]
    local = client.download_artifacts(run_id, "videos/samples/step-1.mp4", str(wan_run["out"]))
    with av.open(local) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 5  # the run's 5 frames, two eval prompts side by side, a row per noise
    strips = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    assert any(name.split("/")[-1].startswith("samples+step+1+") for name in strips)  # the strip beside the mp4
    assert (wan_run["out"] / "samples.mp4").is_file() and (wan_run["out"] / "samples.png").is_file()
    for metric in ("eval/distance_teacher", "eval/pixel_kid_teacher", "eval/diversity_ratio", "eval/motion_ratio"):
        assert [m.step for m in client.get_metric_history(run_id, metric)] == [0, 1]


def test_the_exported_pipeline_samples_as_the_students_sampler(wan_run):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_run["student_dir"])
    pipe.set_progress_bar_config(disable=True)
    prompt = ["a cat runs on the grass"]
    torch.manual_seed(99)  # the exported scheduler re-noises from torch's global generator
    latents = pipe(prompt, num_inference_steps=4, guidance_scale=1.0, num_frames=5, height=16, width=16,
                   max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(5), output_type="latent").frames
    noise = torch.randn((1, *LATENT), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([torch.randn((1, *LATENT)) for _ in range(3)])
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=TOKENS)
        _, x0, _ = backward_simulate(DiffusersVelocity(pipe.transformer), noise, student_sigmas(4, FLOW_SHIFT),
                                     torch.full((1,), 4), {"encoder_hidden_states": embeds}, renoise)
    assert torch.allclose(latents, x0, atol=1e-5)
    assert "distilled to 4 steps with DMD2" in (Path(wan_run["student_dir"]) / "README.md").read_text()


def test_the_logged_student_model_generates_videos(wan_run, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", wan_run["client"].tracking_uri)  # where `models:/` resolves
    model = mlflow.pyfunc.load_model("models:/wan-a/latest")  # the registered model is named after the run id
    videos = model.predict(["a red ball"], params={"seed": 3})
    assert videos.shape == (1, 5, 16, 16, 3) and videos.dtype == "uint8"  # one video: frames, height, width, RGB

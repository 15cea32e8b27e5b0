"""The SD3 family end to end on a tiny StableDiffusion3Pipeline built from configs, through the same CLI
a user runs: `dmd2 distill --recipe recipes/sd35-medium-4step.toml --set model.teacher=DIR ...`.

Real Prefect (in-process server), a local Ray, the store on file://, MLflow on sqlite.
"""

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from dmd2.families.sd3.conditioning import INDEX_KEY
from dmd2.model import DiffusersVelocity
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas
from flows.cli import main
from flows.recipe import RECIPES
from infra.store import ArtifactStore
from infra.trainers.prepare import PREPARED_PREFIX
from tests.dmd2.families.sd3.tiny_pipeline import SHIFT, build_tiny_sd3_pipeline
from tests.tracking_db import tracking_uri_in

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign", "the cat on the sign", "a dog on the sign"]
LATENT = (4, 8, 8)  # 16 px, VAE scale factor 2
SMALL = ["data.resolution=16", "train.world_size=1", "train.rollout_batch_size=4", "dmd2.critic_steps_per_rollout=2",
         "train.save_interval=1", "train.eval_interval=1", "eval.reference_steps=4", "optim.lr=1e-3",
         "optim.critic_lr=2e-3", 'eval.prompts=["a photo of a cat", "a red dog"]']


@pytest.fixture(scope="module")
def sd3_runs(prefect_server, shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3run")
    teacher = build_tiny_sd3_pipeline(tmp / "teacher")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    store, uri = (tmp / "store").as_uri(), tracking_uri_in(tmp)

    def distill(run_id: str, rollouts: int) -> dict:
        args = ["distill", "--recipe", str(RECIPES / "sd35-medium-4step.toml"), "--run-id", run_id,
                "--rollouts", str(rollouts), "--store", store, "--tracking-uri", uri,
                "--output-dir", str(tmp / "out"), "--cache-dir", str(tmp / "cache"),
                "--set", f"model.teacher={teacher}", "--set", f"data.prompts={prompts}"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(args + [item for s in SMALL for item in ("--set", s)]) == 0
        out = printed.getvalue()
        assert f"mlflow ui --backend-store-uri {uri}" in out  # the hint names the tracking URI the run used
        client = MlflowClient(uri)
        [run] = client.search_runs([client.get_experiment_by_name("dmd2").experiment_id],
                                   filter_string=f"tags.`dmd2.run_id` = '{run_id}'")
        return {"prepared_now": "prepared inputs (e.g. encoded prompts) were made by this run" in out,
                "student_dir": str(tmp / "out" / run_id / "student"), "mlflow_run_id": run.info.run_id}

    def teacher_samples(run_id: str) -> dict[str, int]:
        """The stored teacher samples of a run's evaluations, and when each file was written."""
        folder = tmp / "store" / run_id / "eval" / "reference"
        return {path.name: path.stat().st_mtime_ns for path in folder.glob("teacher-*")}

    first = distill("sd3-a", 2)
    stored_by_first = teacher_samples("sd3-a")
    other = distill("sd3-b", 1)
    resumed = distill("sd3-a", 3)
    return {"first": first, "other": other, "resumed": resumed, "teacher": teacher, "store": ArtifactStore(store),
            "uri": uri, "teacher_samples": (stored_by_first, teacher_samples("sd3-a"))}


def test_prompts_are_encoded_once_across_runs_and_a_resume(sd3_runs):
    assert [sd3_runs[k]["prepared_now"] for k in ("first", "other", "resumed")] == [True, False, False]
    store = sd3_runs["store"]
    assert len(store._backend.list_dirs(PREPARED_PREFIX)) == 1


def test_the_teachers_samples_are_made_once_per_run_and_read_back_by_its_resume(sd3_runs):
    """The first run of sd3-a stores them with its first evaluation; its resume, in new rank processes, reads
    them (a rank that made them again would store them again)."""
    stored_by_first, after_resume = sd3_runs["teacher_samples"]
    assert sorted(name.rsplit(".", 1)[1] for name in stored_by_first) == ["json", "safetensors"]
    assert after_resume == stored_by_first


def test_rollout_records_carry_prompt_indices_not_embeddings(sd3_runs):
    from safetensors import safe_open

    store = sd3_runs["store"]
    last = store.list_rollouts("sd3-a")[-1]
    record = Path(store.root_uri[len("file://"):]) / "sd3-a" / f"rollout-{last}" / "rollout" / "rank-0.safetensors"
    with safe_open(str(record), "pt") as f:
        keys = set(f.keys())
    assert {f"cond.{INDEX_KEY}", f"neg_cond.{INDEX_KEY}"} <= keys
    assert not [key for key in keys if "embed" in key or "hidden" in key or "pooled" in key]
    samples, latent_bytes = 4, 4 * math.prod(LATENT)  # rollout_batch_size at world size 1; float32 latents
    # x_i and x0_hat per sample, plus a few scalars (sigma, indices) and the safetensors header
    assert record.stat().st_size / samples < 2 * latent_bytes + 200, record.stat().st_size / samples


def test_mlflow_holds_the_teacher_grid_a_student_grid_per_evaluation_and_the_pipeline(sd3_runs):
    client = MlflowClient(sd3_runs["uri"])
    run = client.get_run(sd3_runs["resumed"]["mlflow_run_id"])
    images = [a.path.split("/")[-1] for a in client.list_artifacts(run.info.run_id, "images")]
    assert len([name for name in images if name.startswith("teacher+step+0+") and name.endswith(".png")]) == 1
    student_steps = sorted(int(name.split("+")[2]) for name in images
                           if name.startswith("samples+") and name.endswith(".png"))
    assert student_steps == [0, 1, 2]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "student")} >= {
        "student/model_index.json", "student/transformer", "student/scheduler", "student/README.md"}
    for metric in ("eval/distance_teacher", "eval/pixel_kid_teacher", "eval/diversity_ratio"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [0, 1, 2]


def test_the_exported_pipeline_samples_as_the_students_sampler(sd3_runs):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_runs["resumed"]["student_dir"], low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    prompt = ["a photo of a cat"]
    torch.manual_seed(99)  # SD3's pipeline re-noises from torch's global generator
    latents = pipe(prompt, num_inference_steps=4, guidance_scale=1.0, height=16, width=16,
                   generator=torch.Generator().manual_seed(5), output_type="latent").images
    noise = torch.randn((1, *LATENT), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(99)
    renoise = torch.stack([torch.randn((1, *LATENT)) for _ in range(3)])
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        _, x0, _ = backward_simulate(DiffusersVelocity(pipe.transformer), noise, student_sigmas(4, SHIFT),
                                     torch.full((1,), 4), cond, renoise)
    assert torch.allclose(latents, x0, atol=1e-5)
    card = (sd3_runs["resumed"]["student_dir"] + "/README.md")
    assert "distilled to 4 steps with DMD2" in open(card).read()

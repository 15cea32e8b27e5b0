"""The text-to-image path distills, shown in the suite as a user would check it.

A quick version of the built-in text teacher (the digits with captions, trained here for a fraction of the
cached one's steps, saved with `save_pretrained`) is distilled into a 4-step student by the CLI a user runs
(`dmd2 distill --recipe recipes/digits-sd3-4step.toml`: Prefect, Ray, the store, MLflow), for a short run. The
exported student and the teacher are then loaded with `StableDiffusion3Pipeline.from_pretrained` and sampled by
diffusers' own pipelines, and the pictures judged by the digits classifier, apart from the product's evaluation:

- the student draws the digit its prompt asks for at least QUICK_ACCURACY of the time (the full run's bound:
  95%);
- it is nearer the teacher's many-step guided pictures, in KID on the classifier's features, than the untrained
  student (the teacher's weights under the student's 4-step sampler): below QUICK_KID_FRACTION of its distance
  (the full run's table is in BENCHMARKS.md);
- its diversity (each prompt's spread over noises) is within QUICK_DIVERSITY of the teacher's (as the full run's).
"""

import contextlib
import io
from pathlib import Path

import pytest
import ray
import torch

from dmd2.families.sd3.builtin.captions import DIGIT_NAMES, captions
from dmd2.families.sd3.builtin.pretrain import RESOLUTION, TextTeacherConfig, teacher_dir
from dmd2.family import family_judge
from dmd2.metrics import diversity, kid_to_reference
from flows.cli import main
from flows.recipe import RECIPES
from infra.trainers.cluster import ensure_ray
from tests import background
from tests.tracking_db import tracking_uri_in

# 99% of its 24-step guided pictures show the digit asked for (400 steps: 70%)
QUICK_TEACHER = TextTeacherConfig(vae_steps=150, steps=600, batch_size=64, lr=2e-3, ema_decay=0.99)
# Trained beside the suite's first tests (a minute of CPU; tests/background.py), as `builtin:digits-sd3` is
# trained into a user's cache.
BACKGROUND_JOBS = {"quick text teacher": f"""
import sys
from dmd2.families.sd3.builtin.pretrain import BUILTIN_DIGITS_SD3, TextTeacherConfig, resolve_builtin
resolve_builtin(BUILTIN_DIGITS_SD3, sys.argv[1], {QUICK_TEACHER!r})
"""}
ROLLOUTS = 40
SMALL = [f"train.rollouts={ROLLOUTS}", "train.world_size=1", "train.rollout_batch_size=80",
         f"train.save_interval={ROLLOUTS}", "eval.samples_per_prompt=2", "eval.reference_steps=8",  # its own check: lean
         "optim.lr=1e-3", "optim.critic_lr=3e-3"]  # a short run needs bigger steps than the recipe's long one
SAMPLES_PER_PROMPT = 10
# measured: accuracy 1.00; KID 0.236 against the untrained student's 0.500 (0.47 of it); diversity ratio 1.04
QUICK_ACCURACY = 0.9
QUICK_KID_FRACTION = 0.6
QUICK_DIVERSITY = 0.2
GUIDANCE, REFERENCE_STEPS = 4.5, 24  # the recipe's teacher_guidance_scale; many steps


@pytest.fixture(scope="module")
def quick_teacher() -> Path:
    return teacher_dir(background.wait("quick text teacher"), QUICK_TEACHER)


@pytest.fixture(scope="module")
def two_cpu_ray():
    """The local Ray `dmd2 distill` starts on a 2-core machine: the run's two ranks take both CPUs, so the prompts
    must be encoded (a Ray task of 1 CPU) before the ranks start, or the run waits for ever."""
    if ray.is_initialized():
        ray.shutdown()  # the session's (12 CPUs): the next module to ask for it starts it again
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_ADDRESS", raising=False)
        ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def distilled(prefect_server, two_cpu_ray, shared_cache, quick_teacher, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("text-run")
    args = ["distill", "--recipe", str(RECIPES / "digits-sd3-4step.toml"), "--run-id", "text",
            "--store", (tmp / "store").as_uri(), "--tracking-uri", tracking_uri_in(tmp),
            "--output-dir", str(tmp / "out"), "--cache-dir", str(shared_cache), "--set", f"model.teacher={quick_teacher}"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + [item for s in SMALL for item in ("--set", s)]) == 0
    return tmp / "out" / "text" / "student"


def pictures(pipeline_dir: Path, steps: int, guidance: float, seed: int, scheduler_dir: Path | None = None) -> torch.Tensor:
    """Each digit's first caption sampled SAMPLES_PER_PROMPT times by the pipeline diffusers loads: [N, 3, H, W]
    in [-1, 1], prompt-major."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    extra = {"scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler_dir)} if scheduler_dir else {}
    pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, low_cpu_mem_usage=False, **extra)
    pipe.set_progress_bar_config(disable=True)
    prompts = [captions(digit)[0] for digit in range(len(DIGIT_NAMES)) for _ in range(SAMPLES_PER_PROMPT)]
    torch.manual_seed(seed)  # the student's scheduler re-noises from torch's global generator
    images = pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, height=RESOLUTION, width=RESOLUTION,
                  max_sequence_length=8, generator=torch.Generator().manual_seed(seed), output_type="pt").images
    return images * 2 - 1


@pytest.mark.slow
@pytest.mark.waits_for("quick text teacher")
def test_the_cli_distills_the_text_teacher_into_a_student_that_draws_the_digit_asked_for(distilled, quick_teacher,
                                                                                         shared_cache):
    judge = family_judge("digits").load(shared_cache)
    asked = torch.arange(len(DIGIT_NAMES)).repeat_interleave(SAMPLES_PER_PROMPT)
    reference = judge.features(pictures(quick_teacher, REFERENCE_STEPS, GUIDANCE, seed=1))
    student_images = pictures(distilled, 4, 1.0, seed=2)
    untrained_images = pictures(quick_teacher, 4, 1.0, seed=2, scheduler_dir=distilled / "scheduler")
    teacher_images = pictures(quick_teacher, REFERENCE_STEPS, GUIDANCE, seed=3)

    accuracy = (judge.classify(student_images) == asked).float().mean().item()
    assert accuracy >= QUICK_ACCURACY, accuracy
    student, untrained = (kid_to_reference(judge.features(images), reference, groups=(asked, asked))
                          for images in (student_images, untrained_images))
    assert student < QUICK_KID_FRACTION * untrained, (student, untrained)
    spread = [diversity(judge.features(images), asked) for images in (student_images, teacher_images)]
    assert abs(spread[0] / spread[1] - 1) <= QUICK_DIVERSITY, spread

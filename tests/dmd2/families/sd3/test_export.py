"""dmd2/families/sd3/export.py: the exported diffusers pipeline samples exactly as the student sampler."""

import shutil

import pytest
import torch

from dmd2.families.sd3.export import check_student_grid, export_pipeline, student_scheduler_config
from dmd2.families.sd3.pipeline import check_flow_matching, load_transformer, shift_of
from dmd2.model import DiffusersVelocity
from dmd2.rollout import backward_simulate
from dmd2.schedule import shift_sigma, student_sigmas

NUM_STEPS = 4
PROMPTS = ["a photo of a cat", "a red dog on the sign"]
LATENT_SHAPE = (len(PROMPTS), 4, 8, 8)  # 16 x 16 pixels, vae scale factor 2
RENOISE_SEED = 1234
CARD = {"base_model": "tiny/sd3-teacher", "recipe": {"[student] num_steps": NUM_STEPS, "[optim] lr": 1e-5},
        "metrics": {"eval/fid": 12.3456, "eval/clip_score": 0.31}}


def perturbed_student(teacher_dir):
    student = load_transformer(teacher_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return student


@pytest.fixture(scope="module")
def exported(sd3_dir, tmp_path_factory):
    student = perturbed_student(sd3_dir)
    out_dir = tmp_path_factory.mktemp("export") / "student"
    return student, export_pipeline(sd3_dir, student, NUM_STEPS, shift_of(sd3_dir), out_dir, CARD)


@pytest.fixture(scope="module")
def exported_pipe(exported):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(exported[1], low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("num_steps", [1, 2, 4, 8])
@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
def test_scheduler_grid_is_the_student_grid(num_steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**student_scheduler_config(num_steps, shift))
    scheduler.set_timesteps(num_steps)
    unshifted = torch.tensor([1 - k / num_steps for k in range(num_steps)], dtype=torch.float64)
    expected = torch.cat([shift_sigma(unshifted, shift), torch.zeros(1, dtype=torch.float64)])  # the closed form
    torch.testing.assert_close(scheduler.sigmas.double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(scheduler.timesteps.double(), 1000 * expected[:-1], atol=1e-3, rtol=0)
    check_student_grid(scheduler, num_steps, shift)


def test_check_student_grid_refuses_the_plain_sd3_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    with pytest.raises(RuntimeError, match="differ from the student's"):
        check_student_grid(FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True), NUM_STEPS, 3.0)


def test_export_samples_exactly_as_the_student_sampler(sd3_dir, exported, exported_pipe):
    student, shift = exported[0], shift_of(sd3_dir)  # the student's grid has the teacher's shift
    torch.manual_seed(RENOISE_SEED)  # SD3's pipeline does not pass its generator to scheduler.step
    latents = exported_pipe(PROMPTS, num_inference_steps=NUM_STEPS, guidance_scale=1.0, height=16, width=16,
                            generator=torch.Generator().manual_seed(0), output_type="latent").images

    # prepare_latents: randn_tensor(shape, generator) -> the initial noise, in one draw for the batch
    noise = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(0))
    # each scheduler.step draws randn(latents.shape) from the global generator: step j re-noises to sigma_{j+1}
    torch.manual_seed(RENOISE_SEED)
    renoise = torch.stack([torch.randn(LATENT_SHAPE) for _ in range(NUM_STEPS - 1)])
    with torch.no_grad():
        embeds, _, pooled, _ = exported_pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False)
    cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
    stop = torch.full((len(PROMPTS),), NUM_STEPS)
    _, x0, _ = backward_simulate(DiffusersVelocity(student), noise, student_sigmas(NUM_STEPS, shift), stop, cond,
                                 renoise)
    difference = (latents - x0).abs().max().item()
    print(f"max |pipeline - student sampler| = {difference:.3g}")
    assert difference < 1e-5
    assert x0.abs().max() > 0.1  # a real sample, not a degenerate zero
    _, other, _ = backward_simulate(DiffusersVelocity(student), noise, student_sigmas(NUM_STEPS, shift), stop, cond,
                                    torch.randn(renoise.shape))
    assert (latents - other).abs().max() > 1e-2  # the re-noise draws matter, so they were matched


def test_export_uses_the_student_weights(exported, exported_pipe, sd3_pipe):
    student, _ = exported
    for name, p in exported_pipe.transformer.state_dict().items():
        assert torch.equal(p, student.state_dict()[name]), name
    assert not torch.equal(exported_pipe.transformer.pos_embed.proj.weight, sd3_pipe.transformer.pos_embed.proj.weight)
    for name in ("text_encoder_3", "vae"):
        ours, theirs = getattr(exported_pipe, name).state_dict(), getattr(sd3_pipe, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name


def test_export_decodes_images(exported_pipe):
    torch.manual_seed(0)
    images = exported_pipe(PROMPTS[0], num_inference_steps=NUM_STEPS, guidance_scale=1.0, height=16, width=16,
                           generator=torch.Generator().manual_seed(0)).images
    assert len(images) == 1 and images[0].size == (16, 16)


def test_export_writes_a_model_card_and_a_fixed_grid_scheduler(exported):
    _, out = exported
    card = (out / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: diffusers" in front and 'base_model: "tiny/sd3-teacher"' in front and "- dmd2" in front
    assert "tiny/sd3-teacher" in body and f"num_inference_steps={NUM_STEPS}" in body
    assert "| eval/fid | 12.35 |" in body and "| [optim] lr | 1e-05 |" in body
    config = check_flow_matching(out)  # the export is itself a valid fixed-grid flow-matching teacher
    assert config["stochastic_sampling"] is True and config["shift_terminal"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="sets shift_terminal 0.5, so its shift 2.004"):
        shift_of(out)  # the stored shift is the solved one, not the student's 3.0
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no staging left


def test_export_refuses_an_existing_directory(sd3_dir, exported):
    with pytest.raises(FileExistsError, match="already exists"):
        export_pipeline(sd3_dir, exported[0], NUM_STEPS, 3.0, exported[1], {})


def test_export_refuses_unknown_card_keys(sd3_dir, exported, tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['fid'\]"):
        export_pipeline(sd3_dir, exported[0], NUM_STEPS, 3.0, tmp_path / "out", {"fid": 1.0})


def test_export_refuses_a_ddpm_teacher(sd_dir, exported, tmp_path):
    with pytest.raises(ValueError, match="DDPMScheduler"):
        export_pipeline(sd_dir, exported[0], NUM_STEPS, 3.0, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


class FailingSave(torch.nn.Module):
    def save_pretrained(self, *args, **kwargs):
        raise OSError("disk full")


def test_a_failed_export_leaves_nothing(sd3_dir, tmp_path):
    with pytest.raises(OSError, match="disk full"):
        export_pipeline(sd3_dir, FailingSave(), NUM_STEPS, 3.0, tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_teacher_missing_a_component(sd3_dir, exported, tmp_path):
    teacher = shutil.copytree(sd3_dir, tmp_path / "teacher", ignore=shutil.ignore_patterns("vae"))
    with pytest.raises(ValueError, match="model_index.json lists vae but .* is missing"):
        export_pipeline(teacher, exported[0], NUM_STEPS, 3.0, tmp_path / "out", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]

"""Wan 2.2 A14B's two experts as one teacher: each sample's velocity comes from the expert the pipeline itself
would call at its timestep, and an export of both samples as the project's sampler."""

import torch

from dmd2.families.wan.experts import WanExperts
from dmd2.families.wan.export import export_pipeline
from dmd2.families.wan.family import WanFamily
from dmd2.model import DiffusersVelocity
from dmd2.rollout import backward_simulate
from dmd2.schedule import student_sigmas
from tests.dmd2.families.wan.tiny_pipeline import FLOW_SHIFT

LATENT = (4, 2, 2, 2)
TOKENS = 8


def test_the_velocity_picks_the_expert_the_pipeline_picks_at_every_timestep(wan22_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan22_dir)
    pipe.set_progress_bar_config(disable=True)
    called = []  # (timestep, expert) of every call the pipeline makes
    hooks = [getattr(pipe, name).register_forward_hook(
        lambda module, args, kwargs, out, name=name: called.append((float(kwargs["timestep"][0]), name)),
        with_kwargs=True) for name in ("transformer", "transformer_2")]
    pipe(["a cat runs"], num_frames=5, height=16, width=16, num_inference_steps=6, guidance_scale=1.0,
         output_type="latent", max_sequence_length=TOKENS)
    for hook in hooks:
        hook.remove()
    assert {name for _, name in called} == {"transformer", "transformer_2"}  # the grid crosses the boundary

    experts = WanFamily().load_model(str(wan22_dir))
    assert isinstance(experts, WanExperts)
    timesteps = torch.tensor([t for t, _ in called])
    assert experts.high_noise(timesteps).tolist() == [name == "transformer" for _, name in called]

    # A batch straddling the boundary: every row is its own expert's answer.
    torch.manual_seed(0)
    x, text = torch.randn(len(called), *LATENT), torch.randn(len(called), TOKENS, 16)
    with torch.no_grad():
        both = experts(x, timesteps, text)[0]
        for row, (t, name) in enumerate(called):
            alone = getattr(pipe, name)(x[row:row + 1], torch.tensor([t]), text[row:row + 1], return_dict=False)[0]
            assert torch.allclose(both[row], alone[0], atol=1e-5), (row, name)


def samples_as_the_students_sampler(out, student) -> None:
    """The export's stock 4-step sampling of one prompt equals the project's sampler over ``student`` (1e-5)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(3)  # the exported scheduler re-noises from torch's global generator
    latents = pipe(["a red ball"], num_frames=5, height=16, width=16, num_inference_steps=4, guidance_scale=1.0,
                   output_type="latent", max_sequence_length=TOKENS,
                   generator=torch.Generator().manual_seed(7)).frames
    noise = torch.randn((1, *LATENT), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(3)
    renoise = torch.stack([torch.randn((1, *LATENT)) for _ in range(3)])
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(["a red ball"], do_classifier_free_guidance=False, max_sequence_length=TOKENS)
        _, x0, _ = backward_simulate(DiffusersVelocity(student), noise, student_sigmas(4, FLOW_SHIFT),
                                     torch.full((1,), 4), {"encoder_hidden_states": embeds}, renoise)
    assert torch.allclose(latents, x0, atol=1e-5)


def test_an_export_of_both_experts_samples_as_the_students_sampler(wan22_dir, tmp_path):
    from diffusers import WanPipeline

    student = WanFamily().load_model(str(wan22_dir))
    out = export_pipeline(wan22_dir, student, 4, FLOW_SHIFT, tmp_path / "student", {"recipe": "test"})
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == student.boundary_ratio
    samples_as_the_students_sampler(out, student)
    assert "distilled to 4 steps with DMD2" in (out / "README.md").read_text()


def test_a_student_of_one_expert_trains_that_expert_alone_and_exports_a_one_transformer_pipeline(wan22_dir, tmp_path):
    """`[student] expert = "transformer_2"`: the actor group's model is the low-noise expert (asked at every step,
    high noise too), the critic keeps both; the export's pipeline calls that expert at every step."""
    from dmd2.config import config_from_dict
    from dmd2.families.wan.pipeline import experts
    from infra.trainers.configs import compute_trainer_configs
    from infra.trainers.models import role_model

    config = config_from_dict({"model": {"family": "wan", "teacher": str(wan22_dir)},
                               "student": {"expert": "transformer_2"}})
    family = WanFamily()
    held = {trainer.role: role_model(family.load_model(trainer.init), family, trainer, config)
            for trainer in compute_trainer_configs(config, "checkpoints")}
    assert isinstance(held["critic"], WanExperts) and not isinstance(held["actor"], WanExperts)
    low_noise = WanFamily().load_model(str(wan22_dir)).transformer_2.state_dict()
    assert all(torch.equal(value, low_noise[key]) for key, value in held["actor"].state_dict().items())
    out = export_pipeline(wan22_dir, held["actor"], 4, FLOW_SHIFT, tmp_path / "student", {"recipe": "test"})
    assert experts(out) == (["transformer"], None)
    samples_as_the_students_sampler(out, held["actor"])

"""One DMD2 rollout on Wan's 5-D video latents [C, F, H, W] (the tiny WanTransformer3DModel, conditioned by prompt
index through the family's table of UMT5 embeddings) against an explicit computation, sample by sample."""

import copy

import torch

from dmd2.config import config_from_dict
from dmd2.families.sd3.family import PromptIndices
from dmd2.families.wan.family import WanFamily
from dmd2.loop import run_rollout
from dmd2.plan import rollout_plan
from dmd2.trainer import train_state
from tests.dmd2.families.explicit_rollout import assert_the_rollout_matches, explicit_rollout_metrics
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole
from tests.dmd2.families.wan.tiny_pipeline import FLOW_SHIFT

PROMPTS = ["a cat runs", "a red ball on the grass", "the dog jumps"]
SHAPE = (4, 2, 2, 2)  # 5 frames of 16 x 16 px: C, (5 - 1) / 4 + 1, 16 / 8, 16 / 8
MAX_TOKENS = 16


def test_the_prompt_table_is_the_pipelines_own_encoding(wan_dir, wan_pipe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = config_from_dict({"model": {"family": "wan", "teacher": str(wan_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": MAX_TOKENS, "frames": 5,
                                        "resolution": 16, "negative_prompt": "blurry"}})
    table = WanFamily().prepare(config)["prompts"]
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS + PROMPTS):  # training prompts, then the eval prompts (the first four)
            embeds, _ = wan_pipe.encode_prompt([prompt], do_classifier_free_guidance=False,
                                               max_sequence_length=MAX_TOKENS)
            assert torch.allclose(table["prompt_embeds"][row], embeds[0], atol=1e-6)
        negative, _ = wan_pipe.encode_prompt(["blurry"], do_classifier_free_guidance=False,
                                             max_sequence_length=MAX_TOKENS)
    assert torch.allclose(table["negative_prompt_embeds"], negative, atol=1e-6)


def test_parts_encoded_by_several_workers_merge_into_the_table_one_worker_makes(wan_dir, tmp_path):
    """10 prompts and the first 4 again as the eval set: 14 rows, 2 encoder batches, one per part."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(10)) + "\n")
    config = config_from_dict({"model": {"family": "wan", "teacher": str(wan_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": MAX_TOKENS, "frames": 5,
                                        "resolution": 16}})
    parts = assert_parts_merge_to_the_whole(WanFamily(), config, 2)
    assert [len(part["prompts"]["prompt_embeds"]) for part in parts] == [8, 6]


def test_one_rollout_on_video_latents_matches_an_explicit_per_sample_computation(wan_dir, wan_pipe):
    config = config_from_dict({
        "model": {"family": "wan", "teacher": str(wan_dir)}, "student": {"num_steps": 3, "shift": FLOW_SHIFT},
        "optim": {"lr": 1e-3}, "dmd2": {"critic_steps_per_rollout": 1, "teacher_guidance_scale": 3.0,
                                        "sigma_shift": FLOW_SHIFT},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })
    with torch.no_grad():
        embeds, negative = wan_pipe.encode_prompt(PROMPTS, negative_prompt=[""] * 3, max_sequence_length=MAX_TOKENS)
    family = WanFamily().bind({"prompts": {"prompt_embeds": embeds, "negative_prompt_embeds": negative[:1]}})
    teacher = family.load_model(str(wan_dir)).eval().requires_grad_(False)
    student, critic = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
    plan = rollout_plan(config, 0, SHAPE)

    # -- explicit: every sample on its own, the embeddings straight from the pipeline ------------------------------
    w, n = config.dmd2.teacher_guidance_scale, 4

    def v(model, x, sigma, index):
        text = negative[:1] if index < 0 else embeds[index:index + 1]
        return model(hidden_states=x[None], timestep=(1000 * sigma).reshape(1), encoder_hidden_states=text,
                     return_dict=False)[0][0]

    def teacher_x0(x_s, s, index):
        v_neg, v_pos = v(teacher, x_s, s, -1), v(teacher, x_s, s, index)
        return x_s - s * (v_neg + w * (v_pos - v_neg))

    expected = explicit_rollout_metrics(plan.draws, n, SHAPE, len(PROMPTS), 3, FLOW_SHIFT,
                                        lambda x, s, i: v(student, x, s, i), lambda x, s, i: v(critic, x, s, i),
                                        teacher_x0)

    # -- the library: one rollout of the in-process loop ---------------------------------------------------------
    metrics = run_rollout(plan, config, train_state(student, 1e-3, config, family.velocity),
                          train_state(critic, 1e-3, config, family.velocity), family.velocity(teacher),
                          PromptIndices(len(PROMPTS)))
    assert_the_rollout_matches(metrics, expected)

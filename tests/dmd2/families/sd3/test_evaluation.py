"""dmd2/families/sd3/evaluation.py: the grid, the fidelity score and the CLIP score, against explicit
computations on the tiny pipeline."""

import torch
from diffusers import AutoencoderKL

from dmd2.config import config_from_dict
from dmd2.families.sd3.evaluation import SD3Evaluator, image_grid
from dmd2.families.sd3.family import SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_clip

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign"]


def test_grid_places_each_image_side_by_side():
    images = torch.stack([torch.full((3, 4, 4), -1.0), torch.full((3, 4, 4), 1.0)])
    grid = image_grid(images, border=1)
    assert grid.shape == (6, 11, 3) and grid.dtype.name == "uint8"
    assert (grid[1:5, 1:5] == 0).all() and (grid[1:5, 6:10] == 255).all()


def test_scores_match_an_explicit_computation(sd3_dir, sd3_pipe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    clip_dir = build_tiny_clip(tmp_path / "clip")
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 2, "shift": 3.0},
        "dmd2": {"teacher_guidance_scale": 2.0, "sigma_shift": 3.0}, "train": {"rollout_batch_size": 10},
        "data": {"prompts": str(prompts), "resolution": 16},
        "eval": {"reference_steps": 3, "prompts": ["a red dog", "the cat"], "clip_model": str(clip_dir)},
    })
    family = SD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS + ["a red dog", "the cat"], "")})
    evaluator = SD3Evaluator.build(family, config)
    student = family.velocity(family.load_model(str(sd3_dir)))
    evaluation = evaluator.evaluate(student)

    latents = evaluator.student_share(student)
    reference = evaluator.teacher_samples()["reference"]
    assert abs(evaluation.scores["eval/latent_mse_teacher"] - ((latents - reference) ** 2).mean().item()) < 1e-6
    vae = AutoencoderKL.from_pretrained(str(sd3_dir), subfolder="vae")
    images = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample.detach()
    assert evaluation.media["samples"].shape == (16 + 4, 2 * (16 + 2) + 2, 3)

    from transformers import AutoTokenizer, CLIPModel

    clip, tokenizer = CLIPModel.from_pretrained(str(clip_dir)), AutoTokenizer.from_pretrained(str(clip_dir))
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():  # the images are 16 x 16 already: CLIP's resize is the identity here
        image = clip.get_image_features(pixel_values=(((images.clamp(-1, 1) + 1) / 2) - mean) / std).pooler_output
        text = clip.get_text_features(**tokenizer(["a red dog", "the cat"], padding=True,
                                                  return_tensors="pt")).pooler_output
    expected = [max(100 * torch.dot(i, t).item() / (i.norm() * t.norm()).item(), 0.0) for i, t in zip(image, text)]
    assert abs(evaluation.scores["eval/clip_score"] - sum(expected) / 2) < 1e-3
    assert set(evaluator.reference_media()) == {"teacher"}
    [(name, scores)] = evaluator.baselines()
    assert name == "teacher, 2 steps, guidance 2" and scores["eval/latent_mse_teacher"] > 0


class CountingSD3Family(SD3Family):
    """The SD3 family, counting the teacher's loads (the evaluator's only host-memory-heavy step)."""

    loads = 0

    def load_model(self, path, dtype=None):
        type(self).loads += 1
        return super().load_model(path, dtype)


def test_the_teacher_is_loaded_once_per_run_and_not_at_all_given_the_stored_samples(sd3_dir, sd3_pipe, tmp_path):
    """Two evaluations, the baselines and the reference grid load the teacher once; an evaluator of a later rank
    process handed the samples stored by the first (`references`) loads it never and scores the same."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 2},
        "train": {"rollout_batch_size": 10}, "data": {"prompts": str(prompts), "resolution": 16},
        "eval": {"reference_steps": 3, "prompts": ["a red dog", "the cat"]},
    })
    family = CountingSD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS + ["a red dog", "the cat"],
                                                                      "")})
    student = family.velocity(SD3Family().load_model(str(sd3_dir)))  # not counted: the student's own load
    CountingSD3Family.loads = 0
    first = SD3Evaluator.build(family, config)
    scores = [first.evaluate(student).scores for _ in range(2)]
    first.baselines()
    first.reference_media()
    assert CountingSD3Family.loads == 1 and scores[0] == scores[1]
    later = SD3Evaluator.build(family, config)
    assert later.references_id() == first.references_id()
    later.with_references({name: tensor.clone() for name, tensor in first.references().items()})
    assert later.evaluate(student).scores == scores[0] and later.baselines() == first.baselines()
    assert CountingSD3Family.loads == 1
    other = config.replace("eval", reference_steps=4)  # stored samples of another setting are never handed in
    assert SD3Evaluator.build(family, other).references_id() != first.references_id()


def test_the_ranks_shares_of_an_evaluation_are_its_rows_sampled_whole(sd3_dir, sd3_pipe, tmp_path):
    """Three eval prompts over two ranks (2 + 1) and over four (1 + 1 + 1, the fourth sampling a row it drops):
    the shares, in rank order, are the latents of the evaluation sampled on one rank, the student's and the
    teacher's alike (up to float noise: a matmul's rounding depends on the batch)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 2},
        "train": {"rollout_batch_size": 10}, "data": {"prompts": str(prompts), "resolution": 16},
        "eval": {"reference_steps": 3, "prompts": PROMPTS},
    })
    family = SD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS + PROMPTS, "")})
    evaluator = SD3Evaluator.build(family, config)
    student = family.velocity(family.load_model(str(sd3_dir)))
    whole, teacher = evaluator.student_share(student), evaluator.teacher_share()
    for world_size, sizes in ((2, [2, 1]), (4, [1, 1, 1, 0])):
        shares = [evaluator.student_share(student, rank, world_size) for rank in range(world_size)]
        assert [len(share) for share in shares] == sizes
        torch.testing.assert_close(torch.cat(shares), whole, atol=1e-5, rtol=0)
        teacher_shares = [evaluator.teacher_share(rank, world_size) for rank in range(world_size)]
        for name in ("reference", "baseline"):
            torch.testing.assert_close(torch.cat([share[name] for share in teacher_shares]), teacher[name],
                                       atol=1e-5, rtol=0)

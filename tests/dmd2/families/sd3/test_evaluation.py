"""dmd2/families/sd3/evaluation.py: the grid, the distances to the teacher's samples, diversity, the CLIP score and
the prompt accuracy, against explicit computations on the tiny pipeline (the metrics themselves are tested in
tests/dmd2/test_metrics.py)."""

from contextlib import nullcontext

import pytest
import torch
from diffusers import AutoencoderKL

from dmd2.config import config_from_dict
from dmd2.families.sd3.evaluation import SD3Evaluator, image_grid
from dmd2.families.sd3.family import SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.metrics import kid, pixel_features
from tests.dmd2.families.sd3.collapse import healthy_and_collapsed
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_clip, build_tiny_dinov2

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign"]
EVAL_PROMPTS = ["a red dog", "the cat"]


def evaluator_of(sd3_dir, sd3_pipe, tmp_path, eval_prompts=EVAL_PROMPTS, family=None, **eval_options):
    """An evaluator of the tiny teacher for `eval_prompts`, 2 noises each unless `eval_options` says otherwise."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "student": {"num_steps": 2, "shift": 3.0},
        "dmd2": {"teacher_guidance_scale": 2.0, "sigma_shift": 3.0}, "train": {"rollout_batch_size": 10},
        "data": {"prompts": str(prompts), "resolution": 16},
        "eval": {"reference_steps": 3, "prompts": eval_prompts, "samples_per_prompt": 2} | eval_options,
    })
    family = (family or SD3Family()).bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS + eval_prompts, "")})
    return SD3Evaluator.build(family, config, cache_dir=tmp_path / "cache"), family


def decoded(sd3_dir, latents):
    vae = AutoencoderKL.from_pretrained(str(sd3_dir), subfolder="vae")
    with torch.no_grad():
        return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample


def uint8_pictures(images):
    return [((image.clamp(-1, 1) + 1) / 2 * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for image in images]


def test_grid_places_each_image_side_by_side():
    images = torch.stack([torch.full((3, 4, 4), -1.0), torch.full((3, 4, 4), 1.0)])
    grid = image_grid(images, border=1)
    assert grid.shape == (6, 11, 3) and grid.dtype.name == "uint8"
    assert (grid[1:5, 1:5] == 0).all() and (grid[1:5, 6:10] == 255).all()


def test_grid_puts_image_i_at_row_i_over_columns():
    images = torch.stack([torch.full((3, 2, 2), value) for value in (-1.0, 1.0, 1.0)])
    grid = image_grid(images, columns=2, border=1)
    assert grid.shape == (2 * 3 + 1, 2 * 3 + 1, 3)
    assert (grid[1:3, 1:3] == 0).all() and (grid[1:3, 4:6] == 255).all() and (grid[4:6, 1:3] == 255).all()
    assert (grid[4:6, 4:6] == 0).all()  # no third column: the last cell stays the border's black


def in_reference_units_kid(x, reference, prompt_of):
    """KID with both sets centred on the reference's mean and divided by its RMS deviation, stratified by prompt."""
    x, reference = x.double(), reference.double()
    mean = reference.mean(0)
    scale = (reference - mean).pow(2).mean().sqrt()
    return kid((x - mean) / scale, (reference - mean) / scale, (prompt_of, prompt_of))


def test_scores_match_an_explicit_computation(sd3_dir, sd3_pipe, tmp_path):
    """The eval set is each prompt from 2 noises (row k P + p: prompt p, noise k); without a feature model the
    distance is the pixel KID and diversity is measured on pixels; the CLIP score is CLIPProcessor's and
    CLIPModel's own computation on the pictures as a pipeline outputs them (uint8)."""
    clip_dir = build_tiny_clip(tmp_path / "clip")
    evaluator, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, clip_model=str(clip_dir))
    student = family.velocity(family.load_model(str(sd3_dir)))
    evaluation = evaluator.evaluate(student)

    latents, reference = evaluator.student_share(student), evaluator.teacher_samples()["reference"]
    assert len(latents) == len(reference) == 4 and evaluator.prompt_of().tolist() == [0, 1, 0, 1]
    images, reference_images = decoded(sd3_dir, latents), decoded(sd3_dir, reference)
    pixels = pixel_features(images)
    expected_kid = in_reference_units_kid(pixels, pixel_features(reference_images), evaluator.prompt_of())
    scores = evaluation.scores
    assert scores["eval/pixel_kid_teacher"] == pytest.approx(expected_kid, rel=1e-4, abs=1e-7)
    assert scores["eval/distance_teacher"] == scores["eval/pixel_kid_teacher"] and "eval/kid_teacher" not in scores
    assert "eval/pixel_kid_teacher_se" not in scores  # 2 noises a prompt: too few to estimate its spread
    assert "eval/distance_teacher_se" not in scores
    spread = [(pixels[p] - pixels[p + 2]).norm().item() for p in (0, 1)]  # each prompt's one pair of samples
    teacher = pixel_features(reference_images)
    teacher_spread = [(teacher[p] - teacher[p + 2]).norm().item() for p in (0, 1)]
    assert scores["eval/diversity"] == pytest.approx(sum(spread) / 2, rel=1e-4)
    assert scores["eval/diversity_ratio"] == pytest.approx(sum(spread) / sum(teacher_spread), rel=1e-4)
    assert evaluation.media["samples"].shape == (2 * (16 + 2) + 2, 2 * (16 + 2) + 2, 3)

    from transformers import CLIPModel, CLIPProcessor

    clip, processor = CLIPModel.from_pretrained(str(clip_dir)), CLIPProcessor.from_pretrained(str(clip_dir))
    inputs = processor(text=EVAL_PROMPTS, images=uint8_pictures(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        image = clip.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        text = clip.get_text_features(input_ids=inputs["input_ids"],
                                      attention_mask=inputs["attention_mask"]).pooler_output
    expected = [max(100 * torch.dot(i, text[n % 2]).item() / (i.norm() * text[n % 2].norm()).item(), 0.0)
                for n, i in enumerate(image)]
    assert scores["eval/clip_score"] == pytest.approx(sum(expected) / 4, abs=1e-3)
    assert "eval/prompt_accuracy" not in scores and "eval/latent_mse_teacher" not in scores
    assert set(evaluator.reference_media()) == {"teacher"}
    [(name, baseline)] = evaluator.baselines()
    assert name == "teacher, 2 steps, guidance 2" and set(baseline) == set(scores)


@pytest.mark.parametrize("build", [build_tiny_dinov2, build_tiny_clip])
def test_a_feature_model_is_the_judge_of_the_distance_and_the_diversity(build, sd3_dir, sd3_pipe, tmp_path):
    from transformers import AutoImageProcessor, AutoModel

    model_dir = build(tmp_path / "features")
    evaluator, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, feature_model=str(model_dir))
    student = family.velocity(family.load_model(str(sd3_dir)))
    scores = evaluator.evaluate(student).scores

    model, processor = AutoModel.from_pretrained(str(model_dir)), AutoImageProcessor.from_pretrained(str(model_dir))

    def features(latents):
        pixels = processor(images=uint8_pictures(decoded(sd3_dir, latents)), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            if build is build_tiny_clip:
                return model.get_image_features(pixel_values=pixels).pooler_output
            return model(pixel_values=pixels).pooler_output  # DINOv2: the layer-normed CLS token

    ours, teacher = features(evaluator.student_share(student)), features(evaluator.teacher_samples()["reference"])
    assert scores["eval/kid_teacher"] == pytest.approx(in_reference_units_kid(ours, teacher, evaluator.prompt_of()), rel=1e-4, abs=1e-7)
    assert scores["eval/distance_teacher"] == scores["eval/kid_teacher"] != scores["eval/pixel_kid_teacher"]
    spread = [(ours[p] - ours[p + 2]).norm().item() for p in (0, 1)]
    assert scores["eval/diversity"] == pytest.approx(sum(spread) / 2, rel=1e-4)


def test_each_kid_carries_its_standard_error_from_sets_of_the_eval_sets_noises(sd3_dir, sd3_pipe, tmp_path):
    """4 noises a prompt: two sets of 2 each (noises 0 and 2, 1 and 3), whose KIDs' spread over sqrt(2) is the error."""
    evaluator, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, samples_per_prompt=4)
    student = family.velocity(family.load_model(str(sd3_dir)))
    scores = evaluator.evaluate(student).scores
    ours = pixel_features(decoded(sd3_dir, evaluator.student_share(student)))
    teacher = pixel_features(decoded(sd3_dir, evaluator.teacher_samples()["reference"]))
    prompt_of = evaluator.prompt_of()  # row k P + p: prompt p, noise k
    mean = teacher.double().mean(0)
    scale = (teacher.double() - mean).pow(2).mean().sqrt()
    ours, teacher = (ours.double() - mean) / scale, (teacher.double() - mean) / scale  # the whole reference's units
    sets = [torch.tensor([0, 1, 4, 5]), torch.tensor([2, 3, 6, 7])]  # noises {0, 2} and {1, 3} of both prompts
    kids = torch.tensor([kid(ours[rows], teacher[rows], (prompt_of[rows], prompt_of[rows])) for rows in sets])
    assert scores["eval/pixel_kid_teacher_se"] == pytest.approx(kids.std().item() / 2**0.5, rel=1e-3)
    assert scores["eval/distance_teacher_se"] == scores["eval/pixel_kid_teacher_se"]  # the gate's, for the registry


def test_builtin_digits_reads_the_digit_each_prompt_names(sd3_dir, sd3_pipe, tmp_path, shared_cache):
    """`builtin:digits`: the digits classifier (the family registry's judge, cached) on the pictures grey at 8 x 8;
    the prompt accuracy counts the samples of prompts that name a digit. Pictures drawn as the built-in text
    teacher draws digits (each pixel doubled, grey in RGB) are read as the classifier reads the digits themselves."""
    from dmd2.families.digits.data import load_digits_splits
    from dmd2.families.digits.evaluator import DigitsEvaluator

    prompts = ["a handwritten digit three", "a red dog", "the number seven"]
    evaluator, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, eval_prompts=prompts, feature_model="builtin:digits")
    evaluator.cache_dir = shared_cache
    scores = evaluator.evaluate(family.velocity(family.load_model(str(sd3_dir)))).scores
    assert {"eval/kid_teacher", "eval/prompt_accuracy"} <= set(scores) and 0 <= scores["eval/prompt_accuracy"] <= 1

    splits = load_digits_splits()
    classifier = DigitsEvaluator.load_or_train(shared_cache, splits)
    threes, sevens = (splits.test_images[splits.test_labels == digit][:2] for digit in (3, 7))
    digits = torch.stack([threes[0], sevens[0], sevens[0], threes[1], threes[1], sevens[1]])  # row k P + p
    pictures = digits.repeat_interleave(2, -1).repeat_interleave(2, -2).expand(-1, 3, -1, -1)
    named = [0, 2, 3, 5]  # the rows of "three" and "seven"; "a red dog" names no digit
    expected = (classifier.predict(digits[named]) == torch.tensor([3, 7, 3, 7])).double().mean().item()
    assert evaluator.prompt_accuracy(pictures) == expected > 0.5
    torch.testing.assert_close(evaluator.judge().features(pictures), classifier.features(digits))


def test_a_collapsed_student_scores_no_diversity_and_a_worse_distance(sd3_dir, sd3_pipe, tmp_path):
    healthy, collapsed = healthy_and_collapsed(sd3_dir, sd3_pipe, tmp_path)
    assert collapsed.scores["eval/diversity_ratio"] < 0.01 < 0.5 < healthy.scores["eval/diversity_ratio"]
    assert collapsed.scores["eval/distance_teacher"] > 5 * max(healthy.scores["eval/distance_teacher"], 1e-4)


class CountingSD3Family(SD3Family):
    """The SD3 family, counting the teacher's loads (the evaluator's only host-memory-heavy step)."""

    loads = 0

    def load_model(self, path, dtype=None):
        type(self).loads += 1
        return super().load_model(path, dtype)


def test_the_teacher_is_loaded_once_per_run_and_not_at_all_given_the_stored_samples(sd3_dir, sd3_pipe, tmp_path):
    """Two evaluations, the baselines and the reference grid load the teacher once; an evaluator of a later rank
    process handed the samples stored by the first (`references`) loads it never and scores the same."""
    first, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, family=CountingSD3Family(), samples_per_prompt=3)
    student = family.velocity(SD3Family().load_model(str(sd3_dir)))  # not counted: the student's own load
    CountingSD3Family.loads = 0
    scores = [first.evaluate(student).scores for _ in range(2)]
    first.baselines()
    first.reference_media()
    assert CountingSD3Family.loads == 1 and scores[0] == scores[1]
    later = SD3Evaluator.build(family, first.config)
    assert later.references_id() == first.references_id()
    later.with_references({name: tensor.clone() for name, tensor in first.references().items()})
    assert later.evaluate(student).scores == scores[0] and later.baselines() == first.baselines()
    assert CountingSD3Family.loads == 1
    for change in ({"reference_steps": 4}, {"samples_per_prompt": 2}):
        other = first.config.replace("eval", **change)  # stored samples of another setting are never handed in
        assert SD3Evaluator.build(family, other).references_id() != first.references_id()


def test_the_ranks_shares_of_an_evaluation_are_its_rows_sampled_whole(sd3_dir, sd3_pipe, tmp_path):
    """Three eval prompts from two noises (6 rows) over two ranks (3 + 3) and over four (2 + 2 + 2, the fourth
    sampling rows it drops): the shares, in rank order, are the latents of the evaluation sampled on one rank, the
    student's and the teacher's alike (up to float noise: a matmul's rounding depends on the batch). Every rank
    calls each model as often, with batches as large (a sharded model's forwards are collectives), also where a
    batch (the teacher's: B = 1 with 10 critic steps) is smaller than a share."""
    evaluator, family = evaluator_of(sd3_dir, sd3_pipe, tmp_path, eval_prompts=PROMPTS)
    evaluator.config = evaluator.config.replace("dmd2", critic_steps_per_rollout=10)
    student_model, teacher_model = (family.load_model(str(sd3_dir)) for _ in range(2))
    calls = []  # (model, batch) of each forward
    for name, model in (("student", student_model), ("teacher", teacher_model)):
        model.register_forward_pre_hook(lambda module, args, kwargs, name=name: calls.append(
            (name, len(kwargs["hidden_states"]))), with_kwargs=True)
    evaluator.lent_teacher = lambda: nullcontext(teacher_model)
    student = family.velocity(student_model)
    whole, teacher = evaluator.student_share(student), evaluator.teacher_share()
    for world_size, sizes in ((2, [3, 3]), (4, [2, 2, 2, 0])):
        shares, teacher_shares, ranks_calls = [], [], []
        for rank in range(world_size):
            calls.clear()
            shares.append(evaluator.student_share(student, rank, world_size))
            teacher_shares.append(evaluator.teacher_share(rank, world_size))
            ranks_calls.append(list(calls))
        assert [len(share) for share in shares] == sizes
        assert all(rank_calls == ranks_calls[0] for rank_calls in ranks_calls), ranks_calls
        torch.testing.assert_close(torch.cat(shares), whole, atol=1e-5, rtol=0)
        for name in ("reference", "baseline"):
            torch.testing.assert_close(torch.cat([share[name] for share in teacher_shares]), teacher[name],
                                       atol=1e-5, rtol=0)

"""The built-in text teacher's pieces: captions, tokenizers that know the caption words, its pictures of the digits,
and a (briefly) trained pipeline that loads back through `from_pretrained` and resolves through the family."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dmd2.config import config_from_dict
from dmd2.digits_dataset import load_digits_splits
from dmd2.families.sd3.builtin import captions as captions_module
from dmd2.families.sd3.builtin.captions import DIGIT_NAMES, PHRASINGS, captions, digit_of, eval_prompts
from dmd2.families.sd3.builtin.components import clip_tokenizer
from dmd2.families.sd3.builtin.pretrain import (MAX_SEQUENCE_LENGTH, TextTeacherConfig, digit_images,
                                                resolve_builtin, teacher_dir)
from dmd2.families.sd3.checks import BUILTIN_DIGITS_SD3, claims
from dmd2.families.sd3.family import SD3Family

QUICK = TextTeacherConfig(vae_steps=3, steps=3, batch_size=16)  # a pipeline of the real shapes, barely trained


def test_every_caption_names_its_digit_and_the_eval_prompts_are_one_per_digit():
    for digit in range(10):
        assert [digit_of(caption) for caption in captions(digit)] == [digit] * len(PHRASINGS)
    assert [digit_of(prompt) for prompt in eval_prompts()] == list(range(10))
    assert digit_of("a photo of a cat") is None
    assert digit_of("The number 7") == 7


def test_the_clip_tokenizer_reads_caption_words_whole_and_spells_the_rest():
    tokenizer = clip_tokenizer(10, captions_module.CAPTION_WORDS)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("a picture of the digit seven").input_ids)
    assert tokens[1:-1] == ["a</w>", "picture</w>", "of</w>", "the</w>", "digit</w>", "seven</w>"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("cat").input_ids)[1:-1] == ["c", "a", "t</w>"]
    longest = max((c for d in range(len(DIGIT_NAMES)) for c in captions(d)), key=lambda c: len(c.split()))
    assert len(tokenizer(longest).input_ids) <= 10


def test_area_downsampling_the_teachers_pictures_gives_back_the_digits():
    digits = load_digits_splits().test_images[:50]
    pictures = digit_images(digits)
    assert pictures.shape == (50, 3, 16, 16)
    assert torch.equal(F.avg_pool2d(pictures.mean(1, keepdim=True), 2), digits)


def test_the_builtin_spec_is_claimed_by_sd3_and_resolves_to_a_cached_pipeline(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    assert claims(BUILTIN_DIGITS_SD3)
    path = Path(resolve_builtin(BUILTIN_DIGITS_SD3, tmp_path, QUICK))
    assert path == teacher_dir(tmp_path, QUICK) and (path / "model_index.json").is_file()
    stamp = (path / "transformer").stat().st_mtime_ns
    assert resolve_builtin(BUILTIN_DIGITS_SD3, tmp_path, QUICK) == str(path)  # cached: not trained again
    assert (path / "transformer").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging directory left behind
    pipeline = StableDiffusion3Pipeline.from_pretrained(path)
    pipeline.set_progress_bar_config(disable=True)
    pictures = pipeline("the number three", num_inference_steps=2, max_sequence_length=MAX_SEQUENCE_LENGTH,
                        output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert pictures.shape == (1, 3, 16, 16)
    # The VAE's latent statistics were set from its latents: unit spread, no offset left.
    vae = pipeline.vae
    with torch.no_grad():
        latents = vae.encode(digit_images(load_digits_splits().train_images)).latent_dist.mean
    scaled = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    assert scaled.std().item() == pytest.approx(1.0, abs=1e-3) and abs(scaled.mean().item()) < 1e-3


def test_the_family_resolves_a_pipeline_directory_with_the_recipes_options(tmp_path):
    path = resolve_builtin(BUILTIN_DIGITS_SD3, tmp_path, QUICK)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(eval_prompts()))
    config = config_from_dict({"model": {"teacher": path}, "data": {"prompts": str(prompts),
                                                                    "max_sequence_length": MAX_SEQUENCE_LENGTH}})
    resolved = SD3Family().resolve(config, tmp_path)
    assert resolved.data.resolution == 16 and resolved.student.grid_shift == 3.0
    table = SD3Family().prepare(resolved)["prompts"]
    # The training prompts, then the eval prompts (the first four by default); CLIP's 10 tokens, then T5's.
    assert table["prompt_embeds"].shape == (10 + 4, 10 + MAX_SEQUENCE_LENGTH, 32)

"""dmd2/families/sd3/generation.py: an exported SD3 student's pictures, as its model card says to sample it."""

import numpy as np
import pytest
import torch

from dmd2.family import family_class
from dmd2.families.sd3.export import export_pipeline
from dmd2.families.sd3.pipeline import load_transformer

PROMPTS = ["a photo of a cat", "a red dog on the sign"]
SETTINGS = {"num_steps": 2, "resolution": 16}


@pytest.fixture(scope="module")
def student_dir(sd3_dir, tmp_path_factory):
    return export_pipeline(sd3_dir, load_transformer(sd3_dir), 2, 3.0, tmp_path_factory.mktemp("sd3") / "student", {})


def test_generate_samples_the_export_as_its_model_card_says(student_dir):
    from diffusers import StableDiffusion3Pipeline

    family = family_class("sd3")()
    before = torch.random.get_rng_state()
    images = family.generate(student_dir, PROMPTS, SETTINGS, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's global RNG is left alone
    assert [image.shape for image in images] == [(16, 16, 3)] * 2 and images[0].dtype == np.uint8

    pipe = StableDiffusion3Pipeline.from_pretrained(student_dir)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(3)  # the card: the scheduler re-noises from torch's global generator
    expected = pipe(PROMPTS, num_inference_steps=2, guidance_scale=1.0, height=16, width=16, output_type="np",
                    generator=torch.Generator().manual_seed(3)).images
    np.testing.assert_array_equal(np.stack(images), (expected * 255).round().astype(np.uint8))
    assert not np.array_equal(np.stack(family.generate(student_dir, PROMPTS, SETTINGS, seed=4)), np.stack(images))
    assert family.generate(student_dir, [], SETTINGS) == []

"""dmd2/families/digits/generation.py: `dmd2 sample` and the exported student's generator draw the same pixels."""

import numpy as np
import pytest
import torch

from dmd2.family import family_class
from dmd2.families.digits.model import build_digits_unet
from flows.cli import main


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_generate_draws_the_pixels_of_dmd2_sample(tmp_path, model_dir):
    assert main(["sample", "--model", str(model_dir), "--steps", "3", "--shift", "2", "--num-samples", "12",
                 "--seed", "5", "--out", str(tmp_path / "s.npz")]) == 0
    sampled = np.load(tmp_path / "s.npz")
    pixels = ((sampled["images"][:, 0] + 1) * 127.5).round().astype(np.uint8)  # [-1, 1] -> 0..255
    images = family_class("digits")().generate(model_dir, sampled["labels"].tolist(), {"num_steps": 3, "shift": 2.0},
                                               seed=5)
    assert len(images) == 12 and images[0].dtype == np.uint8 and images[0].shape == (8, 8)
    np.testing.assert_array_equal(np.stack(images), pixels)


@pytest.mark.parametrize("labels, message", [([10], "must lie in 0..9"), ([-1], "must lie in 0..9"),
                                             ([1.5], "is an integer"), (["3"], "is an integer")])
def test_generate_refuses_what_is_not_a_digit_label(model_dir, labels, message):
    with pytest.raises(ValueError, match=message):
        family_class("digits")().generate(model_dir, labels, {"num_steps": 1, "shift": 1.0})

"""dmd2/families/digits/judge.py: another family's RGB pictures read as digits, reached through the registry."""

import pytest
import torch

from dmd2.config import ConfigError
from dmd2.families.digits.data import load_digits_splits
from dmd2.families.digits.evaluator import DigitsEvaluator, EvaluatorConfig
from dmd2.families.digits.judge import DigitsJudge, digit_pixels
from dmd2.family import family_judge


def test_a_digit_drawn_doubled_and_grey_in_rgb_comes_back_exactly():
    digits = load_digits_splits().test_images[:5]
    pictures = digits.repeat_interleave(4, -1).repeat_interleave(4, -2).expand(-1, 3, -1, -1)
    torch.testing.assert_close(digit_pixels(pictures), digits, atol=1e-6, rtol=0)


def test_grey_is_the_mean_of_the_channels_over_each_area():
    pictures = torch.zeros(1, 3, 16, 16)
    pictures[0, 0, :2, :2] = 0.9  # one channel lit in the top-left 2 x 2 block
    assert digit_pixels(pictures)[0, 0, 0, 0].item() == pytest.approx(0.3)
    assert digit_pixels(pictures)[0, 0].flatten()[1:].abs().max() == 0


def test_the_judge_reads_pictures_as_the_classifier_reads_their_digits():
    splits = load_digits_splits()
    judge = DigitsJudge(DigitsEvaluator.train(splits, config=EvaluatorConfig(epochs=1)))
    digits = splits.test_images[:20]
    pictures = digits.repeat_interleave(2, -1).repeat_interleave(2, -2).expand(-1, 3, -1, -1)
    assert torch.equal(judge.classify(pictures), judge.evaluator.predict(digits))
    torch.testing.assert_close(judge.features(pictures), judge.evaluator.features(digits))


def test_the_registry_names_the_judge_each_family_offers():
    assert family_judge("digits") is DigitsJudge
    with pytest.raises(ConfigError, match="the sd3 family offers no picture judge"):
        family_judge("sd3")

"""dmd2/draws.py: per-sample, counter-based draws."""

import pytest
import torch

from dmd2.draws import RolloutDraws, seeded_generator, shard_rows


def test_a_ranks_draws_are_its_slice_of_the_world_size_1_draws():
    draws = RolloutDraws(seed=3, rollout_id=7, global_size=2 * 2 * 4)  # world 2, K = 2, B = 4
    every = torch.arange(16)
    for name, draw in {"normal": lambda rows: draws.normal("noise", rows, (1, 2, 2)),
                       "uniform": lambda rows: draws.uniform("sigma", rows),
                       "integers": lambda rows: draws.integers("stop", 4, rows)}.items():
        full = draw(every)
        for rank in (0, 1):
            rows = shard_rows(rank, world_size=2, steps=2, batch=4)
            assert torch.equal(draw(rows), full[rows]), name


def test_a_samples_numbers_are_its_own_generator_s_whatever_the_batch():
    """Counter-based: sample i of stream s is drawn from the generator of (seed, rollout, s, i) alone."""
    small, large = RolloutDraws(0, 2, 8), RolloutDraws(0, 2, 1024)
    rows = torch.tensor([5, 1])
    assert torch.equal(small.normal("noise", rows, (3,)), large.normal("noise", rows, (3,)))
    expected = torch.randn((3,), generator=seeded_generator(0, 2, "noise", 5))
    assert torch.equal(small.normal("noise", rows, (3,))[0], expected)
    assert not torch.equal(small.normal("noise", rows, (3,)), small.normal("other", rows, (3,)))
    assert not torch.equal(RolloutDraws(0, 3, 8).normal("noise", rows, (3,)), small.normal("noise", rows, (3,)))


def test_a_row_outside_the_global_batch_is_an_error():
    with pytest.raises(IndexError, match="sample index 8 is outside the rollout's global batch of 8"):
        RolloutDraws(0, 0, 8).uniform("sigma", torch.tensor([8]))

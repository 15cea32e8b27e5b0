"""Tests for dmd2/families/digits/data.py, checked against sklearn's raw digits loaded independently."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dmd2.families.digits.data import (
    NULL_CLASS,
    NUM_CLASSES,
    DigitsSplits,
    balanced_labels,
    load_digits_splits,
)


@pytest.fixture(scope="module")
def raw():
    """Raw digits as {pixel bytes (0..16 as uint8): label}; the data set has no duplicate images."""
    digits = load_digits()
    table = {row.astype(np.uint8).tobytes(): int(y) for row, y in zip(digits.data, digits.target)}
    assert len(table) == len(digits.data)
    return table


@pytest.fixture(scope="module")
def splits():
    return load_digits_splits()


def _pixel_keys(images: torch.Tensor) -> list[bytes]:
    """Invert x / 8 - 1 back to the raw 0..16 counts, one bytes key per image."""
    counts = ((images.reshape(len(images), 64).double() + 1) * 8).numpy()
    assert np.array_equal(counts, np.round(counts)), "pixels are not exact images of integer counts"
    return [row.astype(np.uint8).tobytes() for row in counts]


def test_shapes_and_dtypes(splits):
    assert splits.train_images.shape == (1437, 1, 8, 8)
    assert splits.test_images.shape == (360, 1, 8, 8)
    assert splits.train_labels.shape == (1437,) and splits.test_labels.shape == (360,)
    assert splits.train_images.dtype == splits.test_images.dtype == torch.float32
    assert splits.train_labels.dtype == splits.test_labels.dtype == torch.int64


def test_range_is_exactly_minus_one_to_one(splits):
    for images in (splits.train_images, splits.test_images):
        assert images.min().item() == -1.0
        assert images.max().item() == 1.0


def test_splits_are_disjoint_cover_the_data_and_keep_labels(splits, raw):
    train_keys, test_keys = _pixel_keys(splits.train_images), _pixel_keys(splits.test_images)
    assert not set(train_keys) & set(test_keys)
    assert set(train_keys) | set(test_keys) == set(raw)
    assert [raw[k] for k in train_keys] == splits.train_labels.tolist()
    assert [raw[k] for k in test_keys] == splits.test_labels.tolist()


def test_split_is_deterministic_per_seed_and_changes_with_seed(splits):
    again = load_digits_splits(seed=0)
    for name in DigitsSplits.__dataclass_fields__:
        assert torch.equal(getattr(splits, name), getattr(again, name)), name
    other = load_digits_splits(seed=1)
    assert set(_pixel_keys(other.test_images)) != set(_pixel_keys(splits.test_images))


def test_split_is_stratified(splits):
    train_counts = torch.bincount(splits.train_labels, minlength=NUM_CLASSES)
    test_counts = torch.bincount(splits.test_labels, minlength=NUM_CLASSES)
    assert (train_counts > 0).all() and (test_counts > 0).all()
    totals = train_counts + test_counts
    # Stratification keeps each class's held-out share at 20% up to rounding.
    assert ((test_counts.double() - 0.2 * totals).abs() <= 1.0).all()
    assert NULL_CLASS not in torch.cat([splits.train_labels, splits.test_labels]).tolist()


def test_test_fraction_is_validated():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_splits(test_fraction=1.0)


@pytest.mark.parametrize("n", [0, 7, 10, 50, 123])
def test_balanced_labels_counts(n):
    labels = balanced_labels(n)
    assert labels.dtype == torch.int64 and labels.shape == (n,)
    expected = [sum(1 for i in range(n) if i % 10 == c) for c in range(10)]
    assert torch.bincount(labels, minlength=10).tolist() == expected
    if n % 10 == 0:
        assert len(set(expected)) == 1


def test_balanced_labels_with_generator_is_a_seeded_shuffle():
    a = balanced_labels(100, generator=torch.Generator().manual_seed(3))
    b = balanced_labels(100, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.bincount(a, minlength=10).tolist() == [10] * 10
    assert not torch.equal(a, balanced_labels(100))


def test_balanced_labels_rejects_negative_n():
    with pytest.raises(ValueError):
        balanced_labels(-1)

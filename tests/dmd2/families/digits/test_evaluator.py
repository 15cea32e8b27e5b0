"""Tests for dmd2/families/digits/evaluator.py: Frechet distance against closed forms and scipy, and the
trained evaluator's accuracy, persistence and scores."""

import json

import numpy as np
import pytest
import scipy.linalg
import torch

from dmd2.families.digits.data import DigitsSplits, balanced_labels, load_digits_splits
from dmd2.families.digits.evaluator import (
    DigitsEvaluator,
    EvaluatorConfig,
    fd_between,
    feature_stats,
    frechet_distance,
)

# ---------------------------------------------------------------- Frechet distance


def _random_spd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T + 0.1 * np.eye(d)


def test_fd_is_zero_for_identical_sets():
    x = np.random.default_rng(0).normal(size=(200, 16))
    assert abs(fd_between(x, x)) < 1e-6


def test_fd_matches_closed_form_for_diagonal_covariances():
    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=8), rng.normal(size=8)
    a, b = rng.uniform(0.1, 3.0, size=8), rng.uniform(0.1, 3.0, size=8)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-10)


def test_fd_matches_closed_form_for_singular_diagonal_covariances():
    rng = np.random.default_rng(2)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    a = np.array([0.0, 1.0, 2.0, 0.0, 0.5, 0.0])
    b = np.array([0.0, 0.0, 3.0, 1.5, 0.5, 0.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize(
    "m1,s1,m2,s2", [(0.0, 1.0, 0.0, 1.0), (1.5, 0.3, -0.5, 2.0), (3.0, 2.0, 3.0, 0.0)]
)
def test_fd_matches_one_dimensional_closed_form(m1, s1, m2, s2):
    fd = frechet_distance(np.array([m1]), np.array([[s1**2]]), np.array([m2]), np.array([[s2**2]]))
    assert fd == pytest.approx((m1 - m2) ** 2 + (s1 - s2) ** 2, abs=1e-12)


def test_fd_matches_scipy_sqrtm_for_full_covariances():
    rng = np.random.default_rng(3)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    s1, s2 = _random_spd(rng, 5), _random_spd(rng, 5)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2 - 2 * covmean)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-8)


def test_fd_is_symmetric_and_rotation_invariant():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(300, 10)) @ rng.normal(size=(10, 10))
    b = rng.normal(loc=0.5, size=(250, 10)) @ rng.normal(size=(10, 10))
    q, _ = np.linalg.qr(rng.normal(size=(10, 10)))
    fd = fd_between(a, b)
    assert fd > 1.0
    assert fd_between(b, a) == pytest.approx(fd, rel=1e-9)
    assert fd_between(a @ q, b @ q) == pytest.approx(fd, rel=1e-9)


def test_fd_is_finite_with_fewer_samples_than_dimensions():
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(20, 64)), rng.normal(size=(30, 64))
    fd = fd_between(torch.from_numpy(a).float(), torch.from_numpy(b).float())
    assert np.isfinite(fd) and fd > 0


def test_feature_stats_match_explicit_loop():
    x = np.random.default_rng(6).normal(size=(40, 3))
    mu, sigma = feature_stats(x)
    mean = sum(x) / len(x)
    cov = sum(np.outer(r - mean, r - mean) for r in x) / (len(x) - 1)
    np.testing.assert_allclose(mu, mean, rtol=1e-12)
    np.testing.assert_allclose(sigma, cov, rtol=1e-10)


def test_fd_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


# ---------------------------------------------------------------- evaluator


@pytest.fixture(scope="module")
def splits():
    return load_digits_splits()


@pytest.fixture(scope="module")
def evaluator(splits):
    return DigitsEvaluator.train(splits, seed=0)


def test_heldout_accuracy_is_high(evaluator, splits):
    predictions = evaluator.predict(splits.test_images)
    accuracy = (predictions == splits.test_labels).float().mean().item()
    assert accuracy >= 0.97
    assert evaluator.metadata["heldout_accuracy"] == pytest.approx(accuracy)


def test_features_shape_and_batch_independence(evaluator, splits):
    images = splits.test_images[:100]
    feats = evaluator.features(images)
    assert feats.shape == (100, 64) and feats.dtype == torch.float32
    assert (feats >= 0).all()  # penultimate layer is post-ReLU
    one_by_one = torch.cat([evaluator.features(images[i : i + 1]) for i in range(len(images))])
    torch.testing.assert_close(one_by_one, feats, rtol=1e-5, atol=1e-5)


def test_rejects_images_of_the_wrong_shape(evaluator):
    with pytest.raises(ValueError, match=r"\[N, 1, 8, 8\]"):
        evaluator.features(torch.zeros(4, 64))


def test_score_real_heldout_is_close_and_noise_is_far(evaluator, splits):
    real = evaluator.score(splits.test_images, splits.test_labels, splits.train_images)
    noise = torch.randn(360, 1, 8, 8, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    fake = evaluator.score(noise, balanced_labels(360), splits.train_images)
    assert real["fd"] < 10.0
    assert real["accuracy"] >= 0.97
    assert fake["fd"] > 20 * real["fd"]
    assert fake["accuracy"] < 0.25  # chance is 0.1


def test_score_with_permuted_labels_has_low_accuracy_and_same_fd(evaluator, splits):
    right = evaluator.score(splits.test_images, splits.test_labels, splits.train_images)
    wrong = evaluator.score(splits.test_images, (splits.test_labels + 1) % 10, splits.train_images)
    assert wrong["accuracy"] < 0.05
    assert wrong["fd"] == pytest.approx(right["fd"], rel=1e-12)


def test_score_against_cached_features_equals_score(evaluator, splits):
    reference = evaluator.features(splits.train_images)
    cached = evaluator.score_against_features(splits.test_images, splits.test_labels, reference)
    direct = evaluator.score(splits.test_images, splits.test_labels, splits.train_images)
    assert cached == pytest.approx(direct, rel=1e-12)


def test_save_load_round_trip(evaluator, splits, tmp_path):
    path = tmp_path / "evaluator.safetensors"
    evaluator.save(path)
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["metadata"] == evaluator.metadata
    # safetensors layout: little-endian u64 header length, then a JSON header; no pickle.
    raw = path.read_bytes()
    assert raw[8:9] == b"{"
    loaded = DigitsEvaluator.load(path)
    assert loaded.config == evaluator.config
    assert torch.equal(loaded.features(splits.test_images), evaluator.features(splits.test_images))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evaluator.json", "evaluator.safetensors"]


def test_training_is_deterministic_uses_train_split_only_and_spares_global_state(splits):
    config = EvaluatorConfig(epochs=2)
    garbage_test = DigitsSplits(
        train_images=splits.train_images,
        train_labels=splits.train_labels,
        test_images=torch.zeros_like(splits.test_images),
        test_labels=splits.test_labels,
    )
    rng_before, threads_before = torch.get_rng_state(), torch.get_num_threads()
    a = DigitsEvaluator.train(splits, seed=7, config=config)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.get_num_threads() == threads_before
    torch.set_num_threads(threads_before + 1)  # the caller's thread count must not matter
    try:
        b = DigitsEvaluator.train(garbage_test, seed=7, config=config)
    finally:
        torch.set_num_threads(threads_before)
    c = DigitsEvaluator.train(splits, seed=8, config=config)
    feats = a.features(splits.train_images)
    assert torch.equal(feats, b.features(splits.train_images))
    assert not torch.equal(feats, c.features(splits.train_images))


def test_load_or_train_caches_and_keys_on_seed(splits, tmp_path, monkeypatch):
    config = EvaluatorConfig(epochs=1)
    first = DigitsEvaluator.load_or_train(tmp_path, splits, seed=0, config=config)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and not any(name.endswith(".tmp") for name in files)

    def no_training(*args, **kwargs):
        raise AssertionError("cache miss: train was called")

    monkeypatch.setattr(DigitsEvaluator, "train", no_training)
    second = DigitsEvaluator.load_or_train(tmp_path, splits, seed=0, config=config)
    assert torch.equal(first.features(splits.test_images), second.features(splits.test_images))
    with pytest.raises(AssertionError, match="cache miss"):
        DigitsEvaluator.load_or_train(tmp_path, splits, seed=1, config=config)
    with pytest.raises(AssertionError, match="cache miss"):
        DigitsEvaluator.load_or_train(tmp_path, splits, seed=0, config=EvaluatorConfig(epochs=2))


def test_load_or_train_retrains_over_an_incomplete_cache(splits, tmp_path):
    config = EvaluatorConfig(epochs=1)
    DigitsEvaluator.load_or_train(tmp_path, splits, seed=0, config=config)
    sidecar = next(tmp_path.glob("*.json"))
    sidecar.unlink()  # as if the process died between the weights and the sidecar
    again = DigitsEvaluator.load_or_train(tmp_path, splits, seed=0, config=config)
    assert sidecar.exists()
    assert again.metadata["seed"] == 0

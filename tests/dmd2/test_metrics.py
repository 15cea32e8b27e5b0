"""dmd2/metrics.py: KID against its closed form on Gaussians, its unbiasedness, its standard error against the
spread of repeated draws, and diversity against a loop."""

import itertools
import math

import pytest
import torch

from dmd2.metrics import diversity, kid, kid_standard_error, kid_to_reference, pixel_features

DIM, N, M, TRIALS = 4, 50, 80, 4000


def dot_moments(mu_a: float, mu_b: float, dim: int) -> tuple[float, float, float]:
    """E[s], E[s^2], E[s^3] of s = a.b for independent a ~ N(mu_a 1, I_d), b ~ N(mu_b 1, I_d).

    Given b, s ~ N(mu_a 1.b, |b|^2), so E[s | b] = u, E[s^2 | b] = u^2 + |b|^2, E[s^3 | b] = u^3 + 3 u |b|^2 with
    u = mu_a 1.b. Writing b = mu_b 1 + z, z ~ N(0, I_d): u ~ N(m, v) with m = d mu_a mu_b and v = d mu_a^2, so
    E[u^2] = m^2 + v and E[u^3] = m^3 + 3 m v; |b|^2 = d mu_b^2 + 2 mu_b 1.z + |z|^2 has mean d mu_b^2 + d, and
    E[u |b|^2] = m (d mu_b^2 + d) + 2 mu_a mu_b E[(1.z)^2] = m (d mu_b^2 + d + 2) (odd moments of z vanish;
    E[(1.z)^2] = d).
    """
    m, v, b2 = dim * mu_a * mu_b, dim * mu_a ** 2, dim * mu_b ** 2 + dim
    return m, m ** 2 + v + b2, m ** 3 + 3 * m * v + 3 * m * (b2 + 2)


def expected_kernel(mu_a: float, mu_b: float, dim: int) -> float:
    """E[k(a, b)] for k(a, b) = (a.b / d + 1)^3 = 1 + 3 s / d + 3 s^2 / d^2 + s^3 / d^3."""
    s1, s2, s3 = dot_moments(mu_a, mu_b, dim)
    return 1 + 3 * s1 / dim + 3 * s2 / dim ** 2 + s3 / dim ** 3


def population_kid(delta: float, dim: int = DIM) -> float:
    """MMD^2 between N(0, I_d) and N(delta 1, I_d) under the cubic kernel: E k(x, x') + E k(y, y') - 2 E k(x, y)."""
    return expected_kernel(0, 0, dim) + expected_kernel(delta, delta, dim) - 2 * expected_kernel(0, delta, dim)


def kid_trials(delta: float, trials: int = TRIALS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.tensor([kid(torch.randn(N, DIM, generator=generator),
                             torch.randn(M, DIM, generator=generator) + delta) for _ in range(trials)],
                        dtype=torch.float64)


def within_standard_errors(values: torch.Tensor, expected: float, errors: float = 4.0) -> bool:
    """Whether the mean of ``values`` is within ``errors`` standard errors (their spread / sqrt(trials)) of
    ``expected``: a 4-sigma bound fails by chance about once in 16000 seeds, and the seed is fixed."""
    return abs(values.mean().item() - expected) <= errors * values.std().item() / math.sqrt(len(values))


def test_kid_of_two_samples_of_one_distribution_averages_to_zero():
    values = kid_trials(0.0)
    assert population_kid(0.0) == 0
    assert within_standard_errors(values, 0.0)
    assert (values < 0).any()  # unbiased, not clipped: single estimates fall on both sides of 0


@pytest.mark.parametrize("delta", [0.3, 0.6])
def test_kid_averages_to_the_closed_form_under_a_mean_shift(delta):
    assert within_standard_errors(kid_trials(delta), population_kid(delta))


def test_kid_grows_with_the_mean_shift():
    means = [kid_trials(delta, trials=100).mean().item() for delta in (0.0, 0.3, 0.6, 1.2)]
    assert means == sorted(means) and means[-1] > 10 * abs(means[0])


def test_kid_is_the_u_statistic_written_as_a_loop():
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=generator), torch.randn(5, 3, generator=generator) + 0.5

    def k(a, b):
        return (float(a.double() @ b.double()) / 3 + 1) ** 3

    xx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(4), 2)) / (4 * 3)
    yy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(5), 2)) / (5 * 4)
    xy = sum(k(a, b) for a in x for b in y) / (4 * 5)
    assert kid(x, y) == pytest.approx(xx + yy - 2 * xy, rel=1e-12)


def test_kid_refuses_sets_it_cannot_estimate_from():
    with pytest.raises(ValueError, match="at least 2 samples"):
        kid(torch.randn(1, 3), torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"\[N, d\] and \[M, d\]"):
        kid(torch.randn(4, 3), torch.randn(4, 2))


def test_pixel_features_are_area_means_and_a_repeated_image_keeps_its_kid():
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    features = pixel_features(images, size=2)
    assert features.shape == (2, 12)
    assert features[0, 0] == images[0, 0, :2, :2].mean()
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 3, 4, 4, generator=generator), torch.randn(6, 3, 4, 4, generator=generator)
    assert kid(pixel_features(x, 8), pixel_features(y, 8)) == pytest.approx(kid(x.flatten(1), y.flatten(1)))


def test_diversity_is_zero_for_identical_samples_of_each_group():
    features = torch.randn(3, 5).repeat(4, 1)  # 3 groups, each sample repeated 4 times
    assert diversity(features, torch.arange(12) % 3) == 0


def test_diversity_is_the_mean_over_groups_of_the_mean_pairwise_distance():
    generator = torch.Generator().manual_seed(3)
    features, groups = torch.randn(10, 4, generator=generator), torch.tensor([0, 1, 0, 2, 1, 0, 2, 1, 0, 5])
    per_group = []
    for group in (0, 1, 2):  # group 5 has one sample: no pair
        members = [features[i] for i in range(10) if groups[i] == group]
        pairs = list(itertools.combinations(members, 2))
        per_group.append(sum(math.sqrt(float(((a - b) ** 2).sum())) for a, b in pairs) / len(pairs))
    assert diversity(features, groups) == pytest.approx(sum(per_group) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 samples"):
        diversity(features[:2], torch.tensor([0, 1]))


def test_kid_to_reference_reads_the_same_at_any_feature_offset_and_scale():
    """The judge's offset and scale are divided out (the reference's mean and RMS deviation): features in the
    hundreds, all positive, give the KID of the same features centred at unit scale."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=generator, dtype=torch.float64) + 0.5
    y = torch.randn(50, 8, generator=generator, dtype=torch.float64)
    mean = y.mean(0)
    unit = (y - mean).pow(2).mean().sqrt()
    expected = kid((x - mean) / unit, (y - mean) / unit)
    assert kid_to_reference(300 * x + 1000, 300 * y + 1000) == pytest.approx(expected, rel=1e-9)
    assert kid_to_reference(x, y) == pytest.approx(expected, rel=1e-9)


def test_kid_of_stratified_sets_is_unbiased_with_their_groups_and_biased_without():
    """Two sets of one mixture of 5 tight clusters, each cluster drawn 4 times per set (an eval set's prompts, each
    from several noises): with the groups KID averages 0; the plain formula reads below 0, by the stratification's
    missing same-group pairs."""
    generator = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(5, 6, generator=generator, dtype=torch.float64)
    groups = torch.arange(5).repeat(4)

    def draw():
        return centres[groups] + 0.3 * torch.randn(20, 6, generator=generator, dtype=torch.float64)

    trials = [(kid(a, b, (groups, groups)), kid(a, b)) for a, b in ((draw(), draw()) for _ in range(400))]
    grouped, plain = torch.tensor(trials).T
    assert abs(grouped.mean()) < 4 * grouped.std() / math.sqrt(len(grouped))
    assert plain.mean() < -10 * plain.std() / math.sqrt(len(plain))
    with pytest.raises(ValueError, match="same groups"):
        kid(draw(), draw(), (groups, groups.clamp(max=3)))


@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_kids_standard_error_is_the_spread_of_its_sets_mean_over_repeated_draws_and_bounds_the_whole_sets(delta):
    """5 clusters drawn 10 times per set (an eval set's prompts x noises), the student's shifted by ``delta``. Over
    400 draws: the mean of `kid_standard_error` matches the spread of the 5 sets' mean KID (computed here from the
    layout: noise j of every prompt is in set j mod 5), within the small bias of a standard deviation of 5 values;
    and the whole set's KID varies less than that."""
    generator = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(5, 6, generator=generator, dtype=torch.float64)
    groups = torch.arange(5).repeat(10)  # row g + 5 j: prompt g, noise j
    in_set = (torch.arange(50) // 5) % 5

    def draw(shift: float) -> torch.Tensor:
        return centres[groups] + shift + 0.5 * torch.randn(50, 6, generator=generator, dtype=torch.float64)

    estimates, set_means, wholes = [], [], []
    for _ in range(400):
        x, y = draw(delta), draw(0.0)
        mean = y.mean(0)
        unit = (y - mean).pow(2).mean().sqrt()
        x_units, y_units = (x - mean) / unit, (y - mean) / unit
        set_means.append(sum(kid(x_units[in_set == s], y_units[in_set == s], (groups[in_set == s],) * 2)
                             for s in range(5)) / 5)
        estimates.append(kid_standard_error(x, y, (groups, groups)))
        wholes.append(kid_to_reference(x, y, (groups, groups)))
    true_error = torch.tensor(set_means).std().item()
    assert 0.8 < torch.tensor(estimates).mean().item() / true_error < 1.1
    assert torch.tensor(wholes).std().item() <= 1.05 * true_error


def test_kids_standard_error_needs_two_sets_of_two_samples_of_every_group():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(15, 4, generator=generator), torch.randn(15, 4, generator=generator)
    three = torch.arange(5).repeat(3)  # 3 samples of each group: 1 set of 2 at most
    assert math.isnan(kid_standard_error(x, y, (three, three)))
    uneven = torch.tensor([0, 1, 2] * 4 + [3] * 3)  # 4 samples of three groups, 3 of the last: still 1 set
    assert math.isnan(kid_standard_error(x, y, (uneven, uneven)))
    assert kid_standard_error(torch.cat([x, x + 1]), torch.cat([y, y]), (torch.arange(5).repeat(6),) * 2) > 0

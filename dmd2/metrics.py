"""Distances between sets of samples, and the spread within one: pure torch, on feature matrices.

An evaluator turns pictures into features (a vision model's embeddings, or `pixel_features`, the model-free
judge) and compares its student's to the teacher's with `kid`; `diversity` reads whether the student still
draws different pictures from different noise.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

PIXEL_SIZE = 32  # the model-free judge's pictures: area-downsampled to 32 x 32, so it costs little at 1024 px


def kid(x: Tensor, y: Tensor, groups: tuple[Tensor, Tensor] | None = None) -> float:
    """Kernel Inception Distance: the unbiased estimate of MMD^2 between the sets ``x`` [N, d] and ``y`` [M, d]
    (N, M >= 2) under the cubic polynomial kernel k(a, b) = (a.b / d + 1)^3 (Binkowski et al. 2018, "Demystifying
    MMD GANs", eq. 4 and §4), in float64:

        KID = sum_{i != j} k(x_i, x_j) / (N (N-1)) + sum_{i != j} k(y_i, y_j) / (M (M-1))
              - 2 sum_{i, j} k(x_i, y_j) / (N M)

    the full U-statistic over all samples (no subsets: exact at an evaluation's tens of samples).

    Unbiased: over repeated draws its mean is the population MMD^2, so 0 for two samples of one distribution at
    any N and M (a single estimate may be negative). This is why an evaluation of tens of samples reports KID
    and not the Frechet distance, whose plug-in estimate is biased upwards by a term that shrinks like 1/N and
    dominates at such sizes (Binkowski et al. §4; Chong & Forsyth 2020).

    ``groups``: each sample's group in ``x`` and in ``y`` (e.g. its prompt), when the sets are stratified (every
    group drawn a fixed number of times) rather than drawn from the mixture: then every term is the mean over
    groups g, h of the mean kernel between group g's and group h's samples (pairs i != j within a set), which is
    unbiased for the mixtures with equal group weights. The plain formula is not: a stratified set holds fewer
    same-group pairs (n - 1 of N - 1 partners) than a cross pair does (n of N), so with groups that cluster it
    reads below 0 for two samples of one distribution (e.g. -0.11 with 10 digits drawn 10 times each).
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"kid takes feature matrices [N, d] and [M, d], got {tuple(x.shape)} and {tuple(y.shape)}")
    if len(x) < 2 or len(y) < 2:
        raise ValueError(f"kid needs at least 2 samples per set, got {len(x)} and {len(y)}")
    x, y = x.double(), y.double()
    dim = x.shape[1]
    x_groups, y_groups = groups if groups is not None else (torch.zeros(len(x)), torch.zeros(len(y)))
    if not torch.equal(x_groups.unique(), y_groups.unique()):
        raise ValueError("kid's groups: both sets must hold the same groups")

    def kernel(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.T / dim + 1) ** 3

    def weights(row_groups: Tensor, column_groups: Tensor, within: bool) -> Tensor:
        """Each pair's weight: 1 / (G^2 n_g n_h), n_h - 1 partners when pairs i != j of one group."""
        same = row_groups[:, None] == column_groups[None, :]
        rows = (row_groups[:, None] == row_groups[None, :]).sum(1, dtype=torch.float64)
        columns = (column_groups[:, None] == column_groups[None, :]).sum(1, dtype=torch.float64)
        partners = columns[None, :] - (same.double() if within else 0)
        pair = torch.where(partners > 0, 1 / (rows[:, None] * partners.clamp(min=1)), 0.0)
        if within:
            pair.fill_diagonal_(0)
        return pair / len(row_groups.unique()) ** 2

    return ((kernel(x, x) * weights(x_groups, x_groups, True)).sum()
            + (kernel(y, y) * weights(y_groups, y_groups, True)).sum()
            - 2 * (kernel(x, y) * weights(x_groups, y_groups, False)).sum()).item()


def in_reference_units(x: Tensor, reference: Tensor) -> tuple[Tensor, Tensor]:
    """Both sets in float64, centred on the reference's mean and divided by its root mean square deviation."""
    x, reference = x.double(), reference.double()
    mean = reference.mean(0)
    scale = (reference - mean).pow(2).mean().sqrt().clamp(min=torch.finfo(torch.float64).tiny)
    return (x - mean) / scale, (reference - mean) / scale


def kid_to_reference(x: Tensor, reference: Tensor, groups: tuple[Tensor, Tensor] | None = None) -> float:
    """`kid` of ``x`` against ``reference`` in the reference's own units (`in_reference_units`), so that a.b / d is
    about 0 between two independent samples of the reference and 1 for a sample with itself, whatever the judge's
    offset and scale. KID's cubic kernel was sized for Inception's features (entries well under 1); on a small
    classifier's ReLU features (entries in the tens, all positive) a.b / d is in the tens, the cubic term in the
    thousands, and the estimate's spread with it."""
    return kid(*in_reference_units(x, reference), groups)


def kid_standard_error(x: Tensor, reference: Tensor, groups: tuple[Tensor, Tensor], sets: int = 5) -> float:
    """How far `kid_to_reference(x, reference, groups)` may stray from the true distance: the standard deviation of
    the KIDs of ``sets`` disjoint sets over sqrt(``sets``) (each group's samples of ``x`` and of ``reference`` dealt
    to the sets in turn, so every set holds every group; all in the whole reference's units). That is the standard
    error of the mean of the sets' KIDs, an upper bound on the whole set's own (which uses the pairs across sets
    too). Fewer sets when a group has fewer than 2 ``sets`` samples; NaN when not even 2 sets can be dealt."""
    x_groups, y_groups = groups
    labels = y_groups.unique()
    smallest = min(min(int((x_groups == g).sum()), int((y_groups == g).sum())) for g in labels)
    sets = min(sets, smallest // 2)  # kid needs 2 samples of every group in each set
    if sets < 2:
        return float("nan")
    x, reference = in_reference_units(x, reference)

    def dealt(set_groups: Tensor, which: int) -> Tensor:
        return torch.cat([(set_groups == g).nonzero().flatten()[which::sets] for g in labels])

    kids = []
    for which in range(sets):
        rows, reference_rows = dealt(x_groups, which), dealt(y_groups, which)
        kids.append(kid(x[rows], reference[reference_rows], (x_groups[rows], y_groups[reference_rows])))
    return (torch.tensor(kids).std() / sets**0.5).item()


def pixel_features(images: Tensor, size: int = PIXEL_SIZE) -> Tensor:
    """The model-free judge's features: images [N, C, H, W] area-downsampled to ``size`` x ``size`` and flattened,
    [N, C size^2]; `kid` of these is the pixel-space KID. An image smaller than ``size`` is repeated pixel by
    pixel, which leaves k(a, b) unchanged (a.b and d grow by the same factor)."""
    return F.adaptive_avg_pool2d(images.float(), size).flatten(1)


def diversity(features: Tensor, groups: Tensor) -> float:
    """The mean over groups of the mean pairwise Euclidean distance between the group's samples: ``features``
    [N, d], ``groups`` [N] the group of each sample (e.g. its prompt, each sampled from several noises). 0 for a
    collapsed generator (the same picture from every noise); groups of one sample are left out."""
    if len(features) != len(groups):
        raise ValueError(f"{len(features)} samples but {len(groups)} group labels")
    means = [F.pdist(features[groups == group].double()).mean() for group in groups.unique()
             if (groups == group).sum() >= 2]
    if not means:
        raise ValueError("diversity needs a group with at least 2 samples")
    return torch.stack(means).mean().item()

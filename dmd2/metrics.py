"""Distances between sets of samples, and the spread within one: pure torch, on feature matrices.

An evaluator turns pictures into features (a vision model's embeddings, or `pixel_features`, the model-free
judge) and compares its student's to the teacher's with `kid`; `diversity` reads whether the student still
draws different pictures from different noise.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

PIXEL_SIZE = 32  # the model-free judge's pictures: area-downsampled to 32 x 32, so it costs little at 1024 px


def kid(x: Tensor, y: Tensor) -> float:
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
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"kid takes feature matrices [N, d] and [M, d], got {tuple(x.shape)} and {tuple(y.shape)}")
    if len(x) < 2 or len(y) < 2:
        raise ValueError(f"kid needs at least 2 samples per set, got {len(x)} and {len(y)}")
    x, y = x.double(), y.double()
    dim = x.shape[1]

    def kernel(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.T / dim + 1) ** 3

    def within(k: Tensor) -> Tensor:  # the mean over pairs i != j
        n = len(k)
        return (k.sum() - k.diagonal().sum()) / (n * (n - 1))

    return (within(kernel(x, x)) + within(kernel(y, y)) - 2 * kernel(x, y).mean()).item()


def kid_to_reference(x: Tensor, reference: Tensor) -> float:
    """`kid` of ``x`` against ``reference`` after dividing both by the reference's root mean square entry: the
    cubic kernel's a.b / d is then O(1) whatever the judge's scale. KID's kernel was made for Inception's features
    (entries well under 1); on features with entries in the tens (a small classifier's ReLU layer) the cubic term
    is in the millions, and the estimate's spread with it, so a student's KID reads as noise (e.g. -429)."""
    scale = reference.double().pow(2).mean().sqrt().clamp(min=torch.finfo(torch.float64).tiny)
    return kid(x.double() / scale, reference.double() / scale)


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

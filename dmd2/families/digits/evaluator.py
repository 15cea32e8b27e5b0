"""The project's quality yardstick for 8x8 digits: FID's recipe with a small digits classifier.

A classifier trained on the digits *train* split supplies 64-d penultimate features. Generated
samples are scored by (a) the Frechet distance between their features and a reference set's
(quality, or fidelity when the reference is the teacher's samples) and (b) the fraction classified
as the digit they were conditioned on. See docs/architecture.md, "The digits yardstick".
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dmd2.families.digits.data import IMAGE_SHAPE, NUM_CLASSES, DigitsSplits
from dmd2.files import atomic_file

_FORMAT_VERSION = 1  # bump when the architecture or file layout changes, so stale caches retrain


@dataclass(frozen=True)
class EvaluatorConfig:
    """Architecture and training schedule of the evaluator's classifier.

    Attributes:
        width: channels of the first conv; the second has ``2 * width``.
        feature_dim: size of the penultimate (feature) layer that FD is computed on.
        epochs: passes over the train split.
        batch_size: images per Adam step.
        lr: Adam learning rate.
        max_shift: largest random translation in pixels (background-padded), so features do not
            hinge on exact pixel placement that a generator may get slightly wrong.
        noise_std: std of Gaussian noise added to training images, for the same robustness.
        eval_batch_size: images per forward pass in ``features`` / ``predict``.
    """

    width: int = 32
    feature_dim: int = 64
    epochs: int = 30
    batch_size: int = 64
    lr: float = 2e-3
    max_shift: int = 1
    noise_std: float = 0.1
    eval_batch_size: int = 1024


class DigitsClassifier(nn.Module):
    """Small CNN on ``[B, 1, 8, 8]``; its penultimate layer is the evaluator's feature space.

    conv3x3(1->w) -> conv3x3 stride 2 (w->2w) -> linear (->feature_dim, ReLU) -> linear (->10),
    with ReLU after each conv.
    """

    def __init__(self, width: int = 32, feature_dim: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)  # 8x8
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)  # 4x4
        self.fc = nn.Linear(2 * width * 4 * 4, feature_dim)
        self.head = nn.Linear(feature_dim, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 1, 8, 8]`` -> penultimate features ``[B, feature_dim]`` (after ReLU)."""
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return F.relu(self.fc(h.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 1, 8, 8]`` -> logits ``[B, 10]``."""
        return self.head(self.features(x))


def _check_images(images: torch.Tensor) -> None:
    if images.ndim != 4 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(f"expected images of shape [N, 1, 8, 8], got {tuple(images.shape)}.")


def _augment(x: torch.Tensor, cfg: EvaluatorConfig, generator: torch.Generator) -> torch.Tensor:
    """Random translation by up to ``max_shift`` pixels per image, then Gaussian noise.

    Pads with -1 (the background value) rather than wrapping, so a shift never moves ink across
    the border.
    """
    s = cfg.max_shift
    padded = F.pad(x, (s, s, s, s), value=-1.0)
    dy, dx = torch.randint(0, 2 * s + 1, (2, x.shape[0], 1), generator=generator)
    rows, cols = dy + torch.arange(8), dx + torch.arange(8)  # [B, 8] each: a per-image 8x8 window
    batch = torch.arange(x.shape[0])[:, None, None]
    shifted = padded[batch, 0, rows[:, :, None], cols[:, None, :]].unsqueeze(1)
    return shifted + cfg.noise_std * torch.randn(shifted.shape, generator=generator)


@contextmanager
def _one_cpu_thread():
    """Run torch on one CPU thread, restoring the caller's setting after.

    The model is too small to gain from intra-op threads, and a fixed thread count keeps float
    reduction order, hence the trained weights, the same on a 2-core laptop and a 16-core box;
    on a busy machine extra threads also spin-wait (measured 16 s vs 3 s on 2 shared cores).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@_one_cpu_thread()
def _train_classifier(
    images: torch.Tensor, labels: torch.Tensor, cfg: EvaluatorConfig, seed: int
) -> DigitsClassifier:
    """Fit a DigitsClassifier with Adam + cross-entropy, deterministically for ``seed`` on CPU.

    Weight init draws from a forked global RNG, so training leaves the caller's RNG untouched;
    shuffling and augmentation draw from a local generator.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsClassifier(cfg.width, cfg.feature_dim)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    steps_per_epoch = -(-len(images) // cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * steps_per_epoch)
    model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(images), generator=generator)
        for idx in order.split(cfg.batch_size):
            x = _augment(images[idx], cfg, generator)
            loss = F.cross_entropy(model(x), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    return model.eval()


def _as_float64(features: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(features, torch.Tensor):
        features = features.detach().cpu().double().numpy()
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"expected features [N >= 2, D], got shape {features.shape}.")
    return features


def feature_stats(features: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[D]`` and unbiased covariance ``[D, D]`` (float64) of features ``[N, D]``, N >= 2."""
    x = _as_float64(features)
    return x.mean(axis=0), np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1])


def _sqrtm_psd(sigma: np.ndarray) -> np.ndarray:
    """Symmetric PSD square root via eigh; tiny negative eigenvalues from rounding are clipped."""
    eigvals, eigvecs = np.linalg.eigh(sigma)
    return (eigvecs * np.sqrt(np.clip(eigvals, 0.0, None))) @ eigvecs.T


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray
) -> float:
    """Frechet (2-Wasserstein) distance between N(mu1, sigma1) and N(mu2, sigma2).

        d^2 = ||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^{1/2})

    (Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule...", eq. 6: FID; Dowson &
    Landau 1982.) The trace term is computed without a non-symmetric sqrtm: with R = sigma1^{1/2},
    sigma1 sigma2 = R (R sigma2 R) R^{-1} has the eigenvalues of the symmetric PSD R sigma2 R, so
    Tr((sigma1 sigma2)^{1/2}) = sum_i sqrt(lambda_i(R sigma2 R)). This stays real and stable for
    singular covariances (fewer samples than feature dimensions), where scipy's sqrtm needs an
    eps-offset fix.

    Args:
        mu1, mu2: means ``[D]``.
        sigma1, sigma2: covariances ``[D, D]``, symmetric PSD.

    Returns:
        d^2 as a float (float64 arithmetic), >= 0.
    """
    mu1, mu2 = (np.atleast_1d(np.asarray(m, np.float64)) for m in (mu1, mu2))
    sigma1, sigma2 = (np.atleast_2d(np.asarray(s, np.float64)) for s in (sigma1, sigma2))
    d = mu1.shape[0]
    if mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(
            f"shape mismatch: mu1 {mu1.shape}, mu2 {mu2.shape}, "
            f"sigma1 {sigma1.shape}, sigma2 {sigma2.shape}."
        )
    root1 = _sqrtm_psd(sigma1)
    middle = root1 @ sigma2 @ root1
    middle = (middle + middle.T) / 2  # remove rounding asymmetry before eigvalsh
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(middle), 0.0, None)).sum()
    diff = mu1 - mu2
    fd = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * tr_covmean
    return max(float(fd), 0.0)  # a squared distance; negatives are only rounding (~1e-12)


def fd_between(
    features_a: torch.Tensor | np.ndarray, features_b: torch.Tensor | np.ndarray
) -> float:
    """Frechet distance between Gaussians fitted to features ``[N_a, D]`` and ``[N_b, D]``."""
    return frechet_distance(*feature_stats(features_a), *feature_stats(features_b))


def _fingerprint(splits: DigitsSplits) -> str:
    """Hash of the train split, so a cached evaluator is only reused for the data it was fit on."""
    digest = hashlib.sha256(splits.train_images.cpu().numpy().tobytes())
    digest.update(splits.train_labels.cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class DigitsEvaluator:
    """A trained digits classifier plus the metrics built on it (FD of features, accuracy).

    Build with ``train``, ``load`` or ``load_or_train``. All methods take images
    ``[N, 1, 8, 8]`` in ``[-1, 1]`` on any device; the classifier runs on CPU in eval mode.

    Attributes:
        model: the DigitsClassifier, in eval mode.
        config: its EvaluatorConfig.
        metadata: JSON-able facts about the fit: ``seed``, ``data_fingerprint``,
            ``heldout_accuracy`` (on ``splits.test_*``).
    """

    def __init__(self, model: DigitsClassifier, config: EvaluatorConfig, metadata: dict):
        self.model = model.eval()
        self.config = config
        self.metadata = dict(metadata)

    @classmethod
    def train(
        cls, splits: DigitsSplits, seed: int = 0, config: EvaluatorConfig | None = None
    ) -> DigitsEvaluator:
        """Fit on ``splits.train_*`` only; record the accuracy on ``splits.test_*`` in metadata."""
        config = config or EvaluatorConfig()
        images, labels = splits.train_images.cpu(), splits.train_labels.cpu()
        model = _train_classifier(images, labels, config, seed)
        evaluator = cls(model, config, {"seed": seed, "data_fingerprint": _fingerprint(splits)})
        heldout = evaluator.accuracy(splits.test_images, splits.test_labels)
        evaluator.metadata["heldout_accuracy"] = heldout
        return evaluator

    def save(self, path: str | os.PathLike) -> None:
        """Write weights to ``path`` (safetensors) and config + metadata to ``path`` with ``.json``.

        Each file is written atomically; the JSON sidecar goes last, so its presence marks a
        complete save.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        with atomic_file(path) as tmp:
            save_file(state, str(tmp))
        sidecar = {
            "format_version": _FORMAT_VERSION,
            "config": asdict(self.config),
            "metadata": self.metadata,
        }
        text = json.dumps(sidecar, indent=2, sort_keys=True)
        with atomic_file(path.with_suffix(".json")) as tmp:
            tmp.write_text(text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DigitsEvaluator:
        """Inverse of ``save``: read ``path`` (safetensors) and its ``.json`` sidecar."""
        path = Path(path)
        sidecar = json.loads(path.with_suffix(".json").read_text())
        if sidecar.get("format_version") != _FORMAT_VERSION:
            raise ValueError(
                f"{path} has evaluator format {sidecar.get('format_version')}, this code reads "
                f"{_FORMAT_VERSION}; delete it to retrain."
            )
        config = EvaluatorConfig(**sidecar["config"])
        model = DigitsClassifier(config.width, config.feature_dim)
        model.load_state_dict(load_file(path))
        return cls(model, config, sidecar["metadata"])

    @classmethod
    def load_or_train(
        cls,
        cache_dir: str | os.PathLike,
        splits: DigitsSplits,
        seed: int = 0,
        config: EvaluatorConfig | None = None,
    ) -> DigitsEvaluator:
        """The evaluator cached in ``cache_dir`` for (splits, seed, config), else a new one, cached.

        The cache file name hashes the format version, config, seed and train data, so a change in
        any of them trains a fresh evaluator instead of reusing a stale one.
        """
        config = config or EvaluatorConfig()
        key_fields = [_FORMAT_VERSION, asdict(config), seed, _fingerprint(splits)]
        key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"digits_evaluator_{key}.safetensors"
        if path.exists() and path.with_suffix(".json").exists():
            return cls.load(path)
        evaluator = cls.train(splits, seed=seed, config=config)
        evaluator.save(path)
        return evaluator

    @torch.no_grad()
    def _batched(self, fn, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        chunks = images.detach().split(self.config.eval_batch_size)
        outputs = [fn(chunk.to("cpu", torch.float32)) for chunk in chunks]
        return torch.cat(outputs)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate features, float32 ``[N, feature_dim]`` on CPU."""
        return self._batched(self.model.features, images)

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Predicted digit, int64 ``[N]`` on CPU."""
        return self._batched(lambda x: self.model(x).argmax(dim=1), images)

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Fraction of ``images`` [N, 1, 8, 8] classified as ``labels`` [N]."""
        return (self.predict(images) == labels.cpu()).double().mean().item()

    def score(
        self, images: torch.Tensor, labels: torch.Tensor, reference_images: torch.Tensor
    ) -> dict[str, float]:
        """``{"fd", "accuracy"}`` of ``images`` made for ``labels``; FD vs ``reference_images``."""
        return self.score_against_features(images, labels, self.features(reference_images))

    def score_against_features(
        self, images: torch.Tensor, labels: torch.Tensor, reference_features: torch.Tensor
    ) -> dict[str, float]:
        """Like ``score`` with the reference given as cached ``self.features(reference_images)``.

        Returns:
            ``fd``: Frechet distance between the features of ``images`` and ``reference_features``
            (lower is better); ``accuracy``: fraction of ``images`` classified as ``labels``
            (higher is better).
        """
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels.")
        return {
            "fd": fd_between(self.features(images), reference_features),
            "accuracy": self.accuracy(images, labels),
        }

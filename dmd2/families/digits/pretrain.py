"""Pretraining the built-in digits teacher: class-conditional flow matching with label dropout.

Seeded and cached: the same config always gives the same weights, saved with `save_pretrained` under a
directory named by the config's hash, so later runs load it through the same `from_pretrained` path a
user's hub model takes.
"""

import copy
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from diffusers import UNet2DModel

from dmd2.critic import flow_matching_loss, training_sigma
from dmd2.families.digits.checks import BUILTIN_DIGITS
from dmd2.families.digits.data import NULL_CLASS, DigitsSplits
from dmd2.families.digits.model import DIGITS_UNET_CONFIG, build_digits_unet
from dmd2.files import atomic_dir
from dmd2.model import DiffusersVelocity
from dmd2.optim import make_optimizer, optimizer_step
from dmd2.progress import progress_bar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainConfig:
    """Teacher pretraining on the digits train split."""

    steps: int = 1500
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 100
    label_dropout: float = 0.1  # the share of labels replaced by the null class, for CFG
    ema_decay: float = 0.995  # the teacher is the EMA of the trained weights
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps([dataclasses.asdict(self), DIGITS_UNET_CONFIG], sort_keys=True, default=list)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@torch.no_grad()
def _ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for ema_param, param in zip(ema.parameters(), model.parameters()):
        ema_param.lerp_(param, 1 - decay)


def pretrain_teacher(
    splits: DigitsSplits, config: PretrainConfig, progress: Callable[[int, float], None] | None = None
) -> UNet2DModel:
    """Train the digits UNet with the velocity flow-matching loss; returns the EMA weights."""
    torch.manual_seed(config.seed)
    model = build_digits_unet()
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer, scheduler = make_optimizer(model.parameters(), config.lr, (0.9, 0.99), 0.0, config.warmup_steps)
    generator = torch.Generator().manual_seed(config.seed)
    images, labels = splits.train_images, splits.train_labels
    velocity = DiffusersVelocity(model)
    for step in range(config.steps):
        rows = torch.randint(len(images), (config.batch_size,), generator=generator)
        dropped = torch.rand(config.batch_size, generator=generator) < config.label_dropout
        cond = {"class_labels": torch.where(dropped, NULL_CLASS, labels[rows])}
        eps = torch.randn(images[rows].shape, generator=generator)
        sigma = training_sigma(torch.rand(config.batch_size, generator=generator), shift=1.0)
        loss, _, _ = flow_matching_loss(velocity, images[rows], cond, sigma, eps)
        metrics = optimizer_step(model, optimizer, scheduler, loss.mean(), grad_clip=1.0)
        _ema_update(ema, model, config.ema_decay)
        if progress:
            progress(step, metrics["loss"])
    return ema.eval()


def teacher_dir(cache_dir: Path, config: PretrainConfig) -> Path:
    return Path(cache_dir) / f"digits-teacher-{config.fingerprint()}"


def cached_teacher(
    cache_dir: Path, splits: DigitsSplits, config: PretrainConfig, progress: Callable[[int, float], None] | None = None
) -> Path:
    """The teacher's `save_pretrained` directory, pretraining it first if this config is not cached.

    The directory is written under a temporary name and renamed into place, so an interrupted
    pretraining never leaves a cache entry that looks complete.
    """
    target = teacher_dir(cache_dir, config)
    if (target / "config.json").is_file():
        return target
    log.info("pretraining the digits teacher (%d steps), cached at %s", config.steps, target)
    teacher = pretrain_teacher(splits, config, progress)
    with atomic_dir(target) as staging:
        teacher.save_pretrained(staging)
    return target




def resolve_model(spec: str, cache_dir: Path) -> str:
    """A model spec as `from_pretrained` takes it: `builtin:digits` becomes the cached teacher directory
    (pretrained now, with a progress bar, if missing); a directory or a hub id is returned unchanged."""
    if spec != BUILTIN_DIGITS:
        return spec
    from dmd2.families.digits.data import load_digits_splits

    config = PretrainConfig()
    target = teacher_dir(cache_dir, config)
    if (target / "config.json").is_file():
        return str(target)
    with progress_bar(config.steps, "pretrain the digits teacher", unit="step") as bar:
        return str(cached_teacher(cache_dir, load_digits_splits(), config, lambda step, loss: bar.update(1)))

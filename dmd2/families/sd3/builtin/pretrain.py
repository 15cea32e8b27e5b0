"""The built-in text-to-image teacher `builtin:digits-sd3`: a complete StableDiffusion3Pipeline trained on
scikit-learn's digits with captions, made on a CPU in minutes and cached like the digits teacher.

Its images are the digits at 16 x 16 (each pixel doubled), grey in RGB, so that area downsampling to 8 x 8 gives
back what any digits classifier reads. Two stages, seeded:
  1. the VAE (scale factor 2, 4 latent channels) learns to reconstruct them; its `scaling_factor` and
     `shift_factor` are then set from the latents' statistics, as SD3's VAE config carries its own;
  2. the MMDiT learns flow matching on the VAE's latents, conditioned on the captions (`captions`) through the
     pipeline's own text encoders and `encode_prompt` (random, never trained: the MMDiT learns to read them),
     with a tenth of the captions dropped to the empty prompt for classifier-free guidance; the teacher is the
     EMA of its weights.
Saved with `save_pretrained` under a directory named by the config's hash, so a run loads it through the same
`from_pretrained` path a hub SD3.5 snapshot takes; nothing else about it is special.
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
import torch.nn.functional as F

from dmd2.critic import flow_matching_loss, training_sigma
from dmd2.digits_dataset import DigitsSplits
from dmd2.families.sd3.builtin import components
from dmd2.families.sd3.builtin.captions import CAPTION_WORDS, DIGIT_NAMES, PHRASINGS, captions
from dmd2.families.sd3.checks import BUILTIN_DIGITS_SD3
from dmd2.families.sd3.conditioning import NEGATIVE, PromptTable, TableVelocity, prompt_indices
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.files import atomic_dir
from dmd2.model import DiffusersVelocity
from dmd2.optim import make_optimizer, optimizer_step
from dmd2.progress import progress_bar

log = logging.getLogger(__name__)

RESOLUTION = 16  # the digits' 8 x 8, each pixel doubled
UPSCALE = RESOLUTION // 8
SHIFT = 3.0  # the scheduler's time shift, SD3's own
CLIP_MAX_LENGTH = 10  # the CLIP tokenizers know the caption words: the longest caption's 6 and two specials fit
MAX_SEQUENCE_LENGTH = 8  # T5 tokens: the longest caption's words and </s> fit (recipes set [data] to this)
TRANSFORMER = dict(
    sample_size=RESOLUTION // 2, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=32,
    out_channels=4, pos_embed_max_size=8,
)


@dataclass(frozen=True)
class TextTeacherConfig:
    """Both stages' schedules."""

    vae_steps: int = 400
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-3  # per latent value: keeps the latents near a unit Gaussian's scale, not on it
    steps: int = 3000
    batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 100
    caption_dropout: float = 0.1  # the share of captions replaced by the empty prompt, for CFG
    ema_decay: float = 0.995
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps([dataclasses.asdict(self), TRANSFORMER, PHRASINGS, DIGIT_NAMES, RESOLUTION, SHIFT,
                           CLIP_MAX_LENGTH, MAX_SEQUENCE_LENGTH], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def digit_images(images: torch.Tensor) -> torch.Tensor:
    """Digits [N, 1, 8, 8] in [-1, 1] -> the teacher's images [N, 3, 16, 16]: each pixel doubled, grey in RGB."""
    return images.repeat_interleave(UPSCALE, -1).repeat_interleave(UPSCALE, -2).expand(-1, 3, -1, -1).contiguous()


def build_pipeline(seed: int):
    """The untrained pipeline: random components of the teacher's configs."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    tokenizer, t5_tokenizer = components.clip_tokenizer(CLIP_MAX_LENGTH, CAPTION_WORDS), \
        components.t5_tokenizer(CAPTION_WORDS)
    projection = TRANSFORMER["pooled_projection_dim"] // 2
    return StableDiffusion3Pipeline(
        transformer=components.mmdit(seed, **TRANSFORMER), scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        vae=components.small_vae(TRANSFORMER["in_channels"], RESOLUTION // TRANSFORMER["sample_size"]),
        text_encoder=components.clip_text_encoder(tokenizer, projection), tokenizer=tokenizer,
        text_encoder_2=components.clip_text_encoder(tokenizer, projection),
        tokenizer_2=components.clip_tokenizer(CLIP_MAX_LENGTH, CAPTION_WORDS),
        text_encoder_3=components.t5_encoder(len(t5_tokenizer), TRANSFORMER["joint_attention_dim"]),
        tokenizer_3=t5_tokenizer,
    )


def train_vae(vae, images: torch.Tensor, config: TextTeacherConfig, progress: Callable[[str], None]) -> torch.Tensor:
    """Reconstruction with a light KL term; then the VAE's latent shift and scale from its latents' mean and
    spread. Returns the scaled latents of ``images`` (the posterior means), what the MMDiT learns."""
    generator = torch.Generator().manual_seed(config.seed)
    optimizer, scheduler = make_optimizer(vae.parameters(), config.vae_lr, (0.9, 0.99), 0.0, config.warmup_steps)
    for _ in range(config.vae_steps):
        batch = images[torch.randint(len(images), (config.batch_size,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        kl = posterior.kl().mean() / latents[0].numel()
        loss = F.mse_loss(vae.decode(latents).sample, batch) + config.vae_kl_weight * kl
        optimizer_step(vae, optimizer, scheduler, loss, grad_clip=1.0)
        progress("vae")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(512)])
    shift, scale = latents.mean().item(), 1 / latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (latents - shift) * scale


def caption_table(pipeline) -> PromptTable:
    """Every caption encoded by the pipeline's own text encoders: row `digit * len(PHRASINGS) + phrasing`; the
    negative prompt is the empty one."""
    rows = [caption for digit in range(len(DIGIT_NAMES)) for caption in captions(digit)]
    return PromptTable.from_tensors(encode_prompt_table(pipeline, rows, "", max_sequence_length=MAX_SEQUENCE_LENGTH))


def train_transformer(pipeline, latents: torch.Tensor, labels: torch.Tensor, config: TextTeacherConfig,
                      progress: Callable[[str], None]) -> torch.nn.Module:
    """Flow matching on the latents with SD3's logit-normal sigmas under the scheduler's shift; the EMA."""
    model = pipeline.transformer.train()
    ema = copy.deepcopy(model).requires_grad_(False)
    velocity = TableVelocity(DiffusersVelocity(model), caption_table(pipeline))
    optimizer, scheduler = make_optimizer(model.parameters(), config.lr, (0.9, 0.99), 0.0, config.warmup_steps)
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.steps):
        rows = torch.randint(len(latents), (config.batch_size,), generator=generator)
        phrasing = torch.randint(len(PHRASINGS), (config.batch_size,), generator=generator)
        dropped = torch.rand(config.batch_size, generator=generator) < config.caption_dropout
        cond = prompt_indices(torch.where(dropped, NEGATIVE, labels[rows] * len(PHRASINGS) + phrasing))
        eps = torch.randn(latents[rows].shape, generator=generator)
        sigma = training_sigma(torch.rand(config.batch_size, generator=generator), shift=SHIFT,
                               sampling="logit_normal")
        loss, _, _ = flow_matching_loss(velocity, latents[rows], cond, sigma, eps)
        optimizer_step(model, optimizer, scheduler, loss.mean(), grad_clip=1.0)
        with torch.no_grad():
            for ema_param, param in zip(ema.parameters(), model.parameters()):
                ema_param.lerp_(param, 1 - config.ema_decay)
        progress("mmdit")
    return ema.eval()


def pretrain_text_teacher(splits: DigitsSplits, config: TextTeacherConfig,
                          progress: Callable[[str], None] = lambda stage: None):
    """The trained pipeline (in memory)."""
    pipeline = build_pipeline(config.seed)
    latents = train_vae(pipeline.vae, digit_images(splits.train_images), config, progress)
    pipeline.transformer = train_transformer(pipeline, latents, splits.train_labels, config, progress)
    return pipeline


def teacher_dir(cache_dir: Path, config: TextTeacherConfig) -> Path:
    return Path(cache_dir) / f"digits-sd3-teacher-{config.fingerprint()}"


def resolve_builtin(spec: str, cache_dir: Path, config: TextTeacherConfig | None = None) -> str:
    """`builtin:digits-sd3` as the cached pipeline directory (trained now, with a progress bar, when missing);
    any other spec unchanged. Written under a staging name and renamed into place, so an interrupted training
    never leaves a directory that looks complete."""
    if spec != BUILTIN_DIGITS_SD3:
        return spec
    config = config or TextTeacherConfig()
    target = teacher_dir(cache_dir, config)
    if (target / "model_index.json").is_file():
        return str(target)
    from dmd2.digits_dataset import load_digits_splits

    log.info("training the built-in text teacher (%d + %d steps), cached at %s", config.vae_steps, config.steps,
             target)
    with progress_bar(config.vae_steps + config.steps, "train the digits text teacher", unit="step") as bar:
        pipeline = pretrain_text_teacher(load_digits_splits(), config, lambda stage: bar.update(1))
    with atomic_dir(target) as staging:
        pipeline.save_pretrained(staging, safe_serialization=True)
    return str(target)

"""Tiny diffusers pipelines built from configs (no downloads), for the SD3 family's tests.

`build_tiny_sd3_pipeline` is a real `StableDiffusion3Pipeline` with every component SD3 has (two CLIP
text encoders with projections, a T5 encoder, their tokenizers, an MMDiT, a VAE and a flow-matching
scheduler), only a few thousand parameters each. `build_sd3_pipeline` is the same with any MMDiT
config (bench/gpu.py builds a full-size SD3.5 Medium transformer with it): the text encoders and the
VAE stay as small as the transformer's input widths allow. `build_tiny_sd_pipeline` is a Stable
Diffusion 1.x pipeline with a DDPM scheduler: the teacher the SD3 family must refuse.
"""

import string
from pathlib import Path

import torch
from diffusers import (
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from dmd2.families.sd3.builtin import components
from dmd2.families.sd3.builtin.components import CLIP_HIDDEN, t5_encoder

SHIFT = 3.0
JOINT_ATTENTION_DIM = 32  # T5's width; the CLIP hidden states are zero-padded to it
CLIP_PROJECTION = 16  # each CLIP's pooled width: 16 + 16 = pooled_projection_dim
CLIP_MAX_LENGTH = 32  # the CLIP tokenizers pad to this (SD3's real ones: 77)
TINY_TRANSFORMER = dict(
    sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=JOINT_ATTENTION_DIM, caption_projection_dim=16, pooled_projection_dim=2 * CLIP_PROJECTION,
    out_channels=4, pos_embed_max_size=8,
)
T5_WORDS = ["a", "cat", "dog", "photo", "of", "red", "blue", "sign", "the", "on"]


def clip_tokenizer(max_length: int = CLIP_MAX_LENGTH):
    return components.clip_tokenizer(max_length)


def t5_tokenizer():
    return components.t5_tokenizer(T5_WORDS, string.ascii_lowercase)


def clip_text_config(vocab_size: int, projection_dim: int | None = None, max_length: int = CLIP_MAX_LENGTH):
    return components.clip_text_config(vocab_size, projection_dim, max_length)


def tiny_vae(latent_channels: int = 4, scale_factor: int = 2):
    return components.small_vae(latent_channels, scale_factor)


def tiny_sd3_transformer(seed: int = 0, **config) -> SD3Transformer2DModel:
    """An MMDiT of `TINY_TRANSFORMER`'s config, with `config`'s keys replacing its own."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(**(TINY_TRANSFORMER | config))


def build_sd3_pipeline(path: str | Path, transformer: dict | None = None, seed: int = 0, vae_scale_factor: int = 2,
                       clip_max_length: int = CLIP_MAX_LENGTH, t5_layers: int = 2,
                       transformer_dtype: torch.dtype | None = None) -> Path:
    """Save a StableDiffusion3Pipeline (FlowMatchEulerDiscreteScheduler, shift 3) of random weights into `path`.

    `transformer` updates `TINY_TRANSFORMER` (e.g. a full-size MMDiT's config); the other components
    are tiny but give what it expects: T5 of width joint_attention_dim (the two CLIPs' 16-wide hidden
    states are zero-padded to it), CLIP projections of pooled_projection_dim / 2 each, a VAE of
    in_channels latent channels. `transformer_dtype` (e.g. bf16) is the dtype its weights are saved in.
    """
    config = TINY_TRANSFORMER | (transformer or {})
    if config["pooled_projection_dim"] % 2 or 2 * CLIP_HIDDEN > config["joint_attention_dim"]:
        raise ValueError(f"pooled_projection_dim {config['pooled_projection_dim']} must be even and "
                         f"joint_attention_dim {config['joint_attention_dim']} >= {2 * CLIP_HIDDEN}")
    torch.manual_seed(seed)
    tokenizer, t5_tok = clip_tokenizer(clip_max_length), t5_tokenizer()
    projection = config["pooled_projection_dim"] // 2

    def clip() -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(clip_text_config(len(tokenizer), projection, clip_max_length))

    model = tiny_sd3_transformer(seed, **config)
    pipeline = StableDiffusion3Pipeline(
        transformer=model if transformer_dtype is None else model.to(transformer_dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        vae=tiny_vae(config["in_channels"], vae_scale_factor),
        text_encoder=clip(), tokenizer=tokenizer, text_encoder_2=clip(), tokenizer_2=clip_tokenizer(clip_max_length),
        text_encoder_3=t5_encoder(len(t5_tok), config["joint_attention_dim"], t5_layers), tokenizer_3=t5_tok,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)


def build_tiny_sd3_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny StableDiffusion3Pipeline (FlowMatchEulerDiscreteScheduler, shift 3) into `path`."""
    return build_sd3_pipeline(path, seed=seed)


def build_tiny_sd_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny Stable Diffusion 1.x pipeline (UNet, CLIP text encoder, DDPMScheduler) into `path`."""
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=CLIP_HIDDEN, attention_head_dim=2, norm_num_groups=4,
    )
    pipeline = StableDiffusionPipeline(
        vae=tiny_vae(), text_encoder=CLIPTextModel(clip_text_config(len(tokenizer))), tokenizer=tokenizer,
        unet=unet, scheduler=DDPMScheduler(clip_sample=False, steps_offset=1), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)


def build_tiny_clip(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny transformers CLIPModel (16 x 16 images), its tokenizer and its image processor (resize and crop
    to 16, CLIP's normalisation) into `path`: `[eval] clip_model`, loadable by `CLIPProcessor.from_pretrained`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPVisionConfig

    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=16)
    config = CLIPConfig(text_config=clip_text_config(len(tokenizer)).to_dict(), vision_config=vision.to_dict(),
                        projection_dim=16)
    CLIPModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(path)
    return Path(path)


def build_tiny_dinov2(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny transformers Dinov2Model (16 x 16 images, 4 x 4 patches) and its image processor (DINOv2's:
    resize and crop to 16, ImageNet's normalisation) into `path`: an `[eval] feature_model`."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                             image_size=16, patch_size=4)).save_pretrained(path)
    BitImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    return Path(path)

"""Tiny FLUX.1 [dev] pipelines built from configs (no downloads), for the flux family's tests.

`build_tiny_flux_pipeline` saves a real `FluxPipeline` as a user's `save_pretrained` would: a CLIP text encoder
(its pooled vector) and a T5 encoder with tokenizers built from a small vocabulary, a `FluxTransformer2DModel` with
the guidance input (FLUX.1 [dev]'s), a small AutoencoderKL with FLUX's `scaling_factor` and `shift_factor`, and
FLUX.1 [dev]'s scheduler config: dynamic shifting, `mu` from the image's token count.
"""

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel

from dmd2.families.sd3.builtin.components import clip_text_config, clip_tokenizer, small_vae, t5_encoder, t5_tokenizer

LATENT_CHANNELS = 4  # the transformer's in_channels is 4 x this (2 x 2 packing)
VAE_FACTOR = 2  # pixels per latent cell: a 16 px picture is 8 x 8 latents, 4 x 4 = 16 tokens
TEXT_WIDTH = 32  # T5's width: the transformer's joint_attention_dim
CLIP_WIDTH = 16  # CLIP's pooled vector: the transformer's pooled_projection_dim
CLIP_MAX_LENGTH = 16
WORDS = ["a", "cat", "dog", "photo", "of", "red", "blue", "sign", "the", "on"]
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, shift=3.0)  # FLUX.1 [dev]'s scheduler_config.json
SCALING_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's VAE


def tiny_flux_transformer(seed: int = 0, guidance_embeds: bool = True) -> FluxTransformer2DModel:
    """FLUX.1 [dev]'s layout (the guidance input); `guidance_embeds=False`: FLUX.1 [schnell]'s."""
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_WIDTH,
                                  pooled_projection_dim=CLIP_WIDTH, guidance_embeds=guidance_embeds,
                                  axes_dims_rope=(2, 2, 4))


def build_tiny_flux_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny FluxPipeline (random weights) into `path`."""
    torch.manual_seed(seed)
    tokenizer, t5_tok = clip_tokenizer(CLIP_MAX_LENGTH, WORDS), t5_tokenizer(WORDS)
    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=small_vae(LATENT_CHANNELS, VAE_FACTOR, SCALING_FACTOR, SHIFT_FACTOR),
        text_encoder=CLIPTextModel(clip_text_config(len(tokenizer), None, CLIP_MAX_LENGTH)), tokenizer=tokenizer,
        text_encoder_2=t5_encoder(len(t5_tok), TEXT_WIDTH), tokenizer_2=t5_tok,
        transformer=tiny_flux_transformer(seed))
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)

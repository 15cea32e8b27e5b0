"""Tiny Wan pipelines built from configs (no downloads), for the Wan family's tests.

`build_tiny_wan_pipeline` saves a real `WanPipeline` as a user's `save_pretrained` would: a UMT5 encoder and a
tokenizer built from a small vocabulary (the `tokenizers` library, no sentencepiece model), a small
`WanTransformer3DModel`, an `AutoencoderKLWan` of Wan 2.1's factors (8 x spatial, 4 x temporal) with per-channel
latent statistics of its own, and Wan 2.1's scheduler: UniPC in flow-prediction mode with `flow_shift`.
`experts=2` adds `transformer_2` and `boundary_ratio`: Wan 2.2 A14B's layout.
"""

import string
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from dmd2.families.sd3.builtin.components import t5_tokenizer

FLOW_SHIFT = 3.0  # Wan2.1-T2V-1.3B's
BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B's
TEXT_DIM = 16
LATENT_CHANNELS = 4
WORDS = ["a", "cat", "dog", "runs", "jumps", "red", "blue", "ball", "the", "on", "grass"]
# Per-channel latent statistics far from (0, 1), so that a decoder that skipped them would show.
LATENTS_MEAN = [0.5, -0.25, 1.0, 0.0]
LATENTS_STD = [2.0, 0.5, 1.5, 1.0]


def wan_scheduler(flow_shift: float = FLOW_SHIFT) -> UniPCMultistepScheduler:
    """Wan 2.1's scheduler config (its hub snapshot's scheduler_config.json)."""
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   num_train_timesteps=1000)


def tiny_wan_transformer(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                 in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM,
                                 freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def tiny_wan_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=4, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=LATENTS_MEAN,
                            latents_std=LATENTS_STD)


def tiny_umt5(vocab_size: int, seed: int = 0) -> UMT5EncoderModel:
    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=2,
                                       num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                       eos_token_id=1, decoder_start_token_id=0))


def build_tiny_wan_pipeline(path: str | Path, seed: int = 0, experts: int = 1) -> Path:
    """Save a tiny WanPipeline (random weights) into `path`; `experts=2`: two transformers and a boundary_ratio."""
    tokenizer = t5_tokenizer(WORDS, string.ascii_lowercase)
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=tiny_umt5(len(tokenizer), seed), vae=tiny_wan_vae(seed),
        scheduler=wan_scheduler(), transformer=tiny_wan_transformer(seed),
        transformer_2=tiny_wan_transformer(seed + 1) if experts == 2 else None,
        boundary_ratio=BOUNDARY_RATIO if experts == 2 else None)
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)

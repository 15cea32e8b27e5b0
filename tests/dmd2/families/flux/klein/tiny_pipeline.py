"""Tiny FLUX.2 [klein] pipelines built from configs (no downloads), for the flux2_klein family's tests.

`build_tiny_klein_pipeline` saves a real `Flux2KleinPipeline` as a user's `save_pretrained` would: a Qwen3 of 27
thin layers (the pipeline stacks the hidden states of layers 9, 18 and 27) with the byte-level BPE tokenizer of the
Qwen-Image tests and a chat template, a small `Flux2Transformer2DModel` without a guidance input (klein's), an
`AutoencoderKLFlux2` whose batch-norm statistics are far from (0, 1) (a decoder that skipped them would show), and a
scheduler with dynamic shifting (the pipeline passes its own empirical `mu`).
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.dmd2.families.qwen_image.tiny_pipeline import byte_tokenizer

LATENT_CHANNELS = 4  # the VAE's; the samples are 2 x 2 patches of them: 16 channels
VAE_FACTOR = 2  # pixels per latent cell: a 16 px picture is 8 x 8 cells, 4 x 4 patches = 16 tokens
QWEN_WIDTH = 8  # three stacked layers: the transformer's joint_attention_dim is 24
# Qwen3's chat template as the pipeline applies it (enable_thinking=False), without the thinking block
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen3(vocab_size: int, pad: int, eos: int) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab_size, hidden_size=QWEN_WIDTH, intermediate_size=16, num_hidden_layers=27,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=pad, eos_token_id=eos, bos_token_id=None))


def tiny_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                             latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-1.0, 1.0, channels))
    vae.bn.running_var.copy_(torch.linspace(0.25, 4.0, channels))
    return vae


def tiny_klein_transformer() -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=3 * QWEN_WIDTH,
                                   timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False)


def build_tiny_klein_pipeline(path: str | Path, seed: int = 0, is_distilled: bool = False) -> Path:
    """Save a tiny Flux2KleinPipeline (random weights) into `path`: the base model's, or with `is_distilled` a
    step-distilled one's (its pipeline ignores guidance_scale)."""
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    pipeline = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=tiny_vae(),
        text_encoder=tiny_qwen3(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id), tokenizer=tokenizer,
        transformer=tiny_klein_transformer(), is_distilled=is_distilled)
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)

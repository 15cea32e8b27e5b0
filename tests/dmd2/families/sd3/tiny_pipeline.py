"""Tiny diffusers pipelines built from configs (no downloads), for the SD3 family's tests.

`build_tiny_sd3_pipeline` is a real `StableDiffusion3Pipeline` with every component SD3 has (two CLIP
text encoders with projections, a T5 encoder, their tokenizers, an MMDiT, a VAE and a flow-matching
scheduler), only a few thousand parameters each. `build_tiny_sd_pipeline` is a Stable Diffusion 1.x
pipeline with a DDPM scheduler: the teacher the SD3 family must refuse.
"""

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

SHIFT = 3.0
JOINT_ATTENTION_DIM = 32  # T5's width; the CLIP hidden states are zero-padded to it
CLIP_HIDDEN = 16  # each CLIP's width: 16 + 16 = 32 concatenated
CLIP_PROJECTION = 16  # each CLIP's pooled width: 16 + 16 = pooled_projection_dim
CLIP_MAX_LENGTH = 32  # the CLIP tokenizers pad to this (SD3's real ones: 77)
T5_WORDS = ["a", "cat", "dog", "photo", "of", "red", "blue", "sign", "the", "on"]
SPECIALS = {"<|startoftext|>": 0, "<|endoftext|>": 1}


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE tokenizer with no merges: every byte alone and at a word's end (`</w>`)."""
    alphabet = list(bytes_to_unicode().values())
    vocab = dict(SPECIALS)
    for symbol in alphabet + [a + "</w>" for a in alphabet]:
        vocab[symbol] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer() -> T5TokenizerFast:
    """A Unigram tokenizer over a few words and the letters (T5's layout: <pad>, </s>, <unk> first).

    Built with the `tokenizers` library through transformers, so no sentencepiece model is needed.
    """
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in T5_WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def clip_text_config(vocab_size: int, projection_dim: int | None = None) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=CLIP_HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=projection_dim or CLIP_HIDDEN,
        bos_token_id=SPECIALS["<|startoftext|>"], eos_token_id=SPECIALS["<|endoftext|>"],
        pad_token_id=SPECIALS["<|endoftext|>"],
    )


def tiny_vae() -> AutoencoderKL:
    """Two blocks: a vae scale factor of 2. SD3's VAE has no quant convs and shifts its latents."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=16, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def tiny_sd3_transformer(seed: int = 0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=JOINT_ATTENTION_DIM, caption_projection_dim=16,
        pooled_projection_dim=2 * CLIP_PROJECTION, out_channels=4, pos_embed_max_size=8,
    )


def build_tiny_sd3_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny StableDiffusion3Pipeline (FlowMatchEulerDiscreteScheduler, shift 3) into `path`."""
    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    t5_tok = t5_tokenizer()
    pipeline = StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        vae=tiny_vae(),
        text_encoder=CLIPTextModelWithProjection(clip_text_config(len(tokenizer), CLIP_PROJECTION)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip_text_config(len(tokenizer), CLIP_PROJECTION)),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=JOINT_ATTENTION_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )),
        tokenizer_3=t5_tok,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)


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
    """Save a tiny transformers CLIPModel (16 x 16 images) and its tokenizer into `path`: `[eval] clip_model`."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=16)
    config = CLIPConfig(text_config=clip_text_config(len(tokenizer)).to_dict(), vision_config=vision.to_dict(),
                        projection_dim=16)
    CLIPModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)

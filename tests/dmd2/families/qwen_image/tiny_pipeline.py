"""Tiny Qwen-Image pipelines built from configs (no downloads), for the qwen_image family's tests.

`build_tiny_qwen_image_pipeline` saves a real `QwenImagePipeline` as a user's `save_pretrained` would: a tiny
Qwen2.5-VL (its text model is what encodes prompts) with a byte-level BPE tokenizer built from a small vocabulary, a
small `QwenImageTransformer2DModel`, an `AutoencoderKLQwenImage` with per-channel latent statistics far from (0, 1),
and Qwen-Image's scheduler config: dynamic shifting, `mu` from the image's token count, `shift_terminal`.
"""

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, \
    QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

Z_DIM = 4
TEXT_WIDTH = 16
LATENTS_MEAN = [0.5, -0.25, 1.0, 0.0]  # a decoder that skipped the per-channel statistics would show
LATENTS_STD = [2.0, 0.5, 1.5, 1.0]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# QwenImagePipeline's template's words, and the prompts'
WORDS = ["Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
         "spatial", "relationships", "of", "objects", "and", "background", "system", "user", "assistant", "a", "cat",
         "dog", "red", "blue", "photo", "sign", "on"]
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                 max_image_seq_len=8192, shift=1.0, shift_terminal=0.02, time_shift_type="exponential")  # Qwen-Image's


def byte_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE: every byte, merges that make `WORDS` (bare and after a space, "\u0120") a token or a
    few, and Qwen's chat specials, so the pipeline's chat template is ~60 tokens, not ~200 bytes."""
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    merges = []
    for word in WORDS:
        for pieces in (list(word), ["\u0120", *word]):
            while len(pieces) > 1:
                merges.append((pieces[0], pieces[1]))
                pieces[:2] = [pieces[0] + pieces[1]]
                vocab.setdefault(pieces[0], len(vocab))
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)), unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    return tokenizer


def tiny_qwen25_vl(vocab_size: int) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL of width 16 (its vision tower as small; prompts never reach it)."""
    vision_ids = dict(vision_start_token_id=vocab_size, vision_end_token_id=vocab_size + 1,
                      vision_token_id=vocab_size + 2, image_token_id=vocab_size + 3, video_token_id=vocab_size + 4)
    size = vocab_size + 5
    text = {"hidden_size": TEXT_WIDTH, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": size, "max_position_embeddings": 512, "rope_theta": 1e6,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "bos_token_id": None, "eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - 3}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": TEXT_WIDTH}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                               hidden_size=TEXT_WIDTH, vocab_size=size, **vision_ids))


def tiny_qwen_image_transformer(seed: int | None = 0) -> QwenImageTransformer2DModel:
    """The pipeline's transformer; ``seed`` None: from the global RNG as it stands."""
    if seed is not None:
        torch.manual_seed(seed)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_WIDTH,
                                       axes_dims_rope=(2, 2, 4))


def build_tiny_qwen_image_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny QwenImagePipeline (random weights) into `path`: 4 pixels per latent cell (two VAE downsamplings)."""
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=AutoencoderKLQwenImage(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False, True], latents_mean=LATENTS_MEAN,
                                   latents_std=LATENTS_STD),
        text_encoder=tiny_qwen25_vl(len(tokenizer)), tokenizer=tokenizer,
        transformer=tiny_qwen_image_transformer(None))
    pipeline.save_pretrained(path, safe_serialization=True)
    return Path(path)

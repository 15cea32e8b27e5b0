"""Small SD3 pipeline components built from configs: tokenizers from a small vocabulary, thin text encoders, a
small VAE and MMDiT. Nothing is downloaded; `save_pretrained` of a pipeline made of them is a directory that
loads through the same `from_pretrained` code as a hub SD3.5 snapshot.

The built-in text teacher (`pretrain`) is made of these, and the tests' random tiny pipelines are too.
"""

import string

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel
from transformers import T5TokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

CLIP_HIDDEN = 16  # each CLIP's width: two of them concatenated (32) are zero-padded to T5's width
CLIP_SPECIALS = {"<|startoftext|>": 0, "<|endoftext|>": 1}


def clip_tokenizer(max_length: int, words: list[str] = ()) -> CLIPTokenizer:
    """A byte-level BPE tokenizer, padding to `max_length` tokens (the CLIP part of the MMDiT's text sequence;
    SD3's real ones: 77): every byte alone and at a word's end (`</w>`), and each of `words` (lower-case letters)
    one token, by merges that join its letters from the left. Any other word is spelled out byte by byte."""
    alphabet = list(bytes_to_unicode().values())
    symbols = alphabet + [a + "</w>" for a in alphabet]
    merges = []
    for word in words:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces[:2] = [pieces[0] + pieces[1]]
            symbols.append(pieces[0])
    vocab = dict(CLIP_SPECIALS)
    for symbol in symbols:
        vocab.setdefault(symbol, len(vocab))
    merges = list(dict.fromkeys(merges))  # words sharing a prefix share its merges
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(words: list[str], characters: str = string.ascii_lowercase + string.digits) -> T5TokenizerFast:
    """A Unigram tokenizer over `words` and single `characters` (T5's layout: <pad>, </s>, <unk> first), so any
    word of those characters is spelled out. Built with the `tokenizers` library through transformers, so no
    sentencepiece model is needed."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in words]
    pieces += [(character, -5.0) for character in characters]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def clip_text_config(vocab_size: int, projection_dim: int | None, max_length: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=CLIP_HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=max_length, projection_dim=projection_dim or CLIP_HIDDEN,
        bos_token_id=CLIP_SPECIALS["<|startoftext|>"], eos_token_id=CLIP_SPECIALS["<|endoftext|>"],
        pad_token_id=CLIP_SPECIALS["<|endoftext|>"],
    )


def clip_text_encoder(tokenizer: CLIPTokenizer, projection_dim: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(clip_text_config(len(tokenizer), projection_dim, tokenizer.model_max_length))


def t5_encoder(vocab_size: int, width: int, num_layers: int = 2) -> T5EncoderModel:
    """A T5 encoder of `width` (the MMDiT's joint_attention_dim) whose layers are as thin as can be."""
    return T5EncoderModel(T5Config(
        vocab_size=vocab_size, d_model=width, d_kv=8, d_ff=64, num_layers=num_layers, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))


def small_vae(latent_channels: int = 4, scale_factor: int = 2, scaling_factor: float = 1.5305,
              shift_factor: float = 0.0609) -> AutoencoderKL:
    """log2(scale_factor) + 1 blocks of 8-16 channels (each but the last halves the resolution); SD3's VAE has
    no quant convs and shifts its latents (`scaling_factor`, `shift_factor`: SD3's by default)."""
    blocks = scale_factor.bit_length()
    if scale_factor < 2 or 2 ** (blocks - 1) != scale_factor:
        raise ValueError(f"the VAE scale factor must be a power of 2 >= 2, got {scale_factor}")
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        block_out_channels=tuple(min(8 * 2**i, 16) for i in range(blocks)), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
        norm_num_groups=4, sample_size=16, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def mmdit(seed: int, **config) -> SD3Transformer2DModel:
    """An SD3 MMDiT of `config`, its random weights seeded."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(**config)

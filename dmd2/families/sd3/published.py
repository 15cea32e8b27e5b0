"""The MMDiT configs of the published SD3.5 teachers, by hub id: what `transformer/config.json` holds in
each hub repository, kept here so that memory can be measured at their full size with no download (the
weights are never needed for that: the model is built on the meta device).

Sources: the repositories' configs as diffusers' `SD3Transformer2DModel` reads them (SD3.5 Large adds QK
normalisation; SD3.5 Medium also has dual attention in its first 13 blocks: the Diffusers SD3.5 release notes).
"""

SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")

SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
                  dual_attention_layers=(), qk_norm="rms_norm")

# Pixels per latent cell of their VAE (four blocks: three halvings), whose latents have the MMDiT's in_channels.
VAE_SCALE_FACTOR = 8

TRANSFORMERS = {
    "stabilityai/stable-diffusion-3.5-medium": SD35_MEDIUM,
    "stabilityai/stable-diffusion-3.5-large": SD35_LARGE,
}

# The prompt conditioning the MMDiT sees per sample: CLIP-L and CLIP-G (77 tokens each, concatenated and
# padded to T5's width) beside T5-XXL's 256 tokens (`[data] max_sequence_length`), and the pooled CLIP vectors.
CLIP_TOKENS = 77
TEXT_TOKENS = CLIP_TOKENS + 256

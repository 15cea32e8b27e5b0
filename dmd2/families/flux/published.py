"""The configs of the published FLUX.1 [dev] pipeline, by hub id: its `transformer/config.json`, the VAE's and the
scheduler's values read here, kept so that `dmd2 plan` measures memory at full size with no download (the model is
built on the meta device; no weight is needed).

Source: black-forest-labs/FLUX.1-dev as diffusers' `FluxTransformer2DModel` reads it (19 double-stream and 38
single-stream blocks of width 3072 = 24 heads x 128, T5-XXL's 4096-wide text, CLIP-L's 768-wide pooled vector,
the guidance input), its AutoencoderKL (16 latent channels, 8 x), its FlowMatchEulerDiscreteScheduler.
"""

FLUX1_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                             pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX1_VAE = dict(latent_channels=16, block_out_channels=[128, 256, 512, 512], scaling_factor=0.3611,
                 shift_factor=0.1159)
FLUX1_DEV_SCHEDULER = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0,
                           use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                           max_image_seq_len=4096)
T5_TOKENS = 512  # FluxPipeline's default max_sequence_length for [dev]
POOLED = 768

PUBLISHED = {"black-forest-labs/FLUX.1-dev": (FLUX1_DEV_TRANSFORMER, FLUX1_VAE, FLUX1_DEV_SCHEDULER)}

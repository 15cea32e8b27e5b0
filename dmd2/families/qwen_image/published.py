"""The configs of the published Qwen-Image pipeline, by hub id: its transformer's `config.json`, the VAE's and the
scheduler's values read here, kept so that `dmd2 plan` measures memory at full size with no download.

Source: Qwen/Qwen-Image as diffusers' `QwenImageTransformer2DModel` reads it (60 dual-stream blocks of width
3072 = 24 heads x 128, Qwen2.5-VL-7B's 3584-wide text, no guidance input: true CFG), its AutoencoderKLQwenImage
(16 channels, 8 x), its FlowMatchEulerDiscreteScheduler (dynamic shifting up to 8192 tokens).
"""

QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                              num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                              axes_dims_rope=(16, 56, 56))
QWEN_IMAGE_VAE = dict(z_dim=16, temperal_downsample=[False, True, True])
QWEN_IMAGE_SCHEDULER = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=1.0,
                            use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")

PUBLISHED = {"Qwen/Qwen-Image": (QWEN_IMAGE_TRANSFORMER, QWEN_IMAGE_VAE, QWEN_IMAGE_SCHEDULER)}

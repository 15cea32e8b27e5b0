"""The transformer configs of the published Wan 2.1 text-to-video teachers, by hub id: what `transformer/config.json`
holds in each `Wan-AI/*-Diffusers` repository, kept here so that `dmd2 plan` measures memory at their full size with
no download (the model is built on the meta device; no weight is needed).

Sources: the repositories' configs as diffusers' `WanTransformer3DModel` reads them (1.3B: width 1536 = 12 heads x
128, 30 blocks; 14B: 5120 = 40 x 128, 40 blocks, diffusers' defaults), and their AutoencoderKLWan (16 latent
channels, 4 x temporal and 8 x spatial compression).
"""

_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
               freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
               added_kv_proj_dim=None, rope_max_seq_len=1024)

TRANSFORMERS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": dict(_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": dict(_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40),
}
FLOW_SHIFTS = {"Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 3.0, "Wan-AI/Wan2.1-T2V-14B-Diffusers": 5.0}  # their UniPC's
VAE = (16, 4, 8)  # latent channels, temporal factor, spatial factor

"""The built-in digits teacher's architecture: a small class-conditional diffusers UNet2DModel.

Class index 10 is the null class: label dropout during pretraining teaches the unconditional branch
that classifier-free guidance needs.
"""

from diffusers import UNet2DModel

DIGITS_UNET_CONFIG = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D"),
    layers_per_block=1,
    norm_num_groups=8,
    num_class_embeds=11,
)


def build_digits_unet(**overrides) -> UNet2DModel:
    """A freshly initialised digits UNet (seed torch before calling for reproducible weights)."""
    return UNet2DModel(**(DIGITS_UNET_CONFIG | overrides))

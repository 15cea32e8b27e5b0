"""The 2 x 2 packing of latents into tokens that FluxPipeline and QwenImagePipeline feed their transformers
(`_pack_latents` / `_unpack_latents` of both, diffusers 0.42): the algorithm keeps latents [B, C, H, W], and a
family's velocity packs them for the model and unpacks its output."""

from torch import Tensor


def pack(latents: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: token (i, j) holds cells (2i + a, 2j + b) as channels c * 4 + 2a + b."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: Tensor, height: int, width: int) -> Tensor:
    """`pack`'s inverse: [B, (H/2)(W/2), 4C] -> [B, C, H, W]."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)

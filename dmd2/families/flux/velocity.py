"""The velocity of a FLUX.1 transformer as FluxPipeline calls it, for the algorithm's latents [B, C, H, W].

FluxPipeline (diffusers 0.42 `__call__`) feeds `FluxTransformer2DModel` the latents packed 2 x 2 into tokens
[B, (H/2)(W/2), 4C] (`_pack_latents`), `img_ids` [(H/2)(W/2), 3] (row, column of each token), `txt_ids` [L, 3] of
zeros, `timestep = t / 1000` = sigma (not 1000 sigma), and with `guidance_embeds` a `guidance` input [B] (FLUX.1
[dev] is guidance-distilled: the guidance scale enters the model; there is no negative branch). The output is
unpacked back to [B, C, H, W]: the velocity eps - x0 in the algorithm's layout.
"""

import torch
from torch import Tensor, nn

from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.model import Cond, VelocityFn, guided
from dmd2.prompt_index import INDEX_KEY


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[(H/2)(W/2), 3]: (0, row, column) of each packed token, in `pack`'s order."""
    rows, columns = torch.meshgrid(torch.arange(height // 2), torch.arange(width // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


class FluxVelocity:
    """v(x_s, sigma, {"prompt_index": [B]}) of a FluxTransformer2DModel through a prompt table
    (dmd2/flow_pipeline/prompts.py `PromptTable`: T5's tokens and CLIP's pooled vector), at the guidance input
    `guidance` (used only when the model embeds guidance); `true_cfg`: the guided teacher's true CFG on top."""

    def __init__(self, model: nn.Module, table, guidance: float, true_cfg: float = 1.0):
        self.model, self.table, self.guidance, self.true_cfg = model, table, guidance, true_cfg
        self.embeds_guidance = bool(getattr(model, "module", model).config.guidance_embeds)

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        if set(cond) != {INDEX_KEY}:
            raise ValueError(f"FluxVelocity takes the conditioning {{{INDEX_KEY!r}: [B] int64}}, got keys "
                             f"{sorted(cond)}")
        text = {key: value.to(device=x_s.device, dtype=x_s.dtype)
                for key, value in self.table.cond(cond[INDEX_KEY]).items()}
        batch, _, height, width = x_s.shape
        guidance = torch.full((batch,), self.guidance, device=x_s.device, dtype=torch.float32) \
            if self.embeds_guidance else None
        tokens = self.model(hidden_states=pack(x_s), timestep=sigma.to(x_s.dtype), guidance=guidance,
                            img_ids=image_ids(height, width, x_s.device, x_s.dtype),
                            txt_ids=torch.zeros(text["encoder_hidden_states"].shape[1], 3, device=x_s.device,
                                                dtype=x_s.dtype),
                            return_dict=False, **text)[0]
        return unpack(tokens, height, width)

    def guided(self, scale: float, neg_cond: Cond) -> VelocityFn:
        """The teacher's guided velocity (`dmd2.model.guided`): FLUX.1 [dev] takes the scale as its guidance input,
        with no negative branch unless `true_cfg` > 1 adds CFG over `neg_cond` on top; a model without the input
        (FLUX.1 [schnell]) gets plain CFG at the scale."""
        if not self.embeds_guidance:
            return guided(lambda x_s, sigma, cond: self(x_s, sigma, cond), scale, neg_cond)
        at_scale = FluxVelocity(self.model, self.table, scale)
        # FluxPipeline's true CFG (`true_cfg_scale` with a negative prompt): both branches at the guidance input
        return guided(lambda x_s, sigma, cond: at_scale(x_s, sigma, cond), self.true_cfg, neg_cond)

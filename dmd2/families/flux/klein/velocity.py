"""The velocity of a FLUX.2 [klein] transformer as Flux2KleinPipeline calls it, for the algorithm's latents
[B, 4C, h, w] (the VAE's cells patchified 2 x 2 and normalised: dmd2/families/flux/klein/pipeline.py).

Flux2KleinPipeline (diffusers 0.42 `__call__`) feeds `Flux2Transformer2DModel` those latents as tokens [B, h w, 4C]
in row-major order (`_pack_latents`: no further patching, the patchifying was the latents'), 4-D position ids:
`img_ids` (0, row, column, 0) per token (`_prepare_latent_ids`) and `txt_ids` (0, 0, 0, l) per text token
(`_prepare_text_ids`), `timestep = t / 1000` = sigma, and `guidance=None`. Its guidance is plain CFG over the negative
prompt (guidance_scale > 1 on a model that is not step-distilled), so the teacher's real score is `dmd2.model.guided`
around this velocity; this one has no `guided` of its own.
"""

import torch
from torch import Tensor, nn

from dmd2.model import Cond
from dmd2.prompt_index import INDEX_KEY


def image_ids(height: int, width: int, device: torch.device) -> Tensor:
    """[h w, 4]: (0, row, column, 0) of each token, in the tokens' (row-major) order."""
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, columns, zeros], dim=-1).reshape(-1, 4).to(device)


def text_ids(length: int, device: torch.device) -> Tensor:
    """[L, 4]: (0, 0, 0, l) of each text token."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


class KleinVelocity:
    """v(x_s, sigma, {"prompt_index": [B]}) of a Flux2Transformer2DModel through a `StatesTable`."""

    def __init__(self, model: nn.Module, table):
        self.model, self.table = model, table

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        if set(cond) != {INDEX_KEY}:
            raise ValueError(f"KleinVelocity takes the conditioning {{{INDEX_KEY!r}: [B] int64}}, got keys "
                             f"{sorted(cond)}")
        text = self.table.cond(cond[INDEX_KEY])["encoder_hidden_states"].to(device=x_s.device, dtype=x_s.dtype)
        batch, channels, height, width = x_s.shape
        tokens = self.model(hidden_states=x_s.flatten(2).transpose(1, 2), timestep=sigma.to(x_s.dtype),
                            guidance=None, encoder_hidden_states=text, txt_ids=text_ids(text.shape[1], x_s.device),
                            img_ids=image_ids(height, width, x_s.device), return_dict=False)[0]
        return tokens.transpose(1, 2).reshape(batch, channels, height, width)

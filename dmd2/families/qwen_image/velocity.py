"""The velocity of a Qwen-Image transformer as QwenImagePipeline calls it, for the algorithm's latents [B, C, H, W].

QwenImagePipeline (diffusers 0.42 `__call__`) feeds `QwenImageTransformer2DModel` the latents packed 2 x 2 into
tokens [B, (H/2)(W/2), 4C], `img_shapes` [(1, H/2, W/2)] per sample (for its RoPE), the prompt's hidden states with
their mask, and `timestep = t / 1000` = sigma. Its guidance is true CFG over the negative prompt with norm
rescaling: comb = v_neg + w (v_pos - v_neg), then comb * |v_pos| / |comb|, the norms over each token's channels
(the packed layout's last dimension) — not plain CFG, so the teacher's real score takes it from here.
"""

import torch
from torch import Tensor, nn

from dmd2.flow_pipeline.packing import pack, unpack
from dmd2.model import Cond, VelocityFn, cat_cond
from dmd2.prompt_index import INDEX_KEY


def _sequence_ranks(model: nn.Module) -> int:
    """The ranks a model's tokens are split over (`[train] sequence_parallel`: diffusers' context-parallel config,
    which infra.trainers.sequence sets), 1 if none."""
    config = getattr(getattr(model, "module", model), "_parallel_config", None)
    return 1 if config is None else config.context_parallel_config.ulysses_degree


def _padded(states: Tensor, mask: Tensor, ranks: int) -> tuple[Tensor, Tensor]:
    """The prompt's states [B, L, D] and mask [B, L] padded to a multiple of ``ranks`` tokens, masked out (the table
    pads its prompts to the longest, whatever that is): the context-parallel plan splits them over the ranks. The
    padding changes nothing: no token attends to a masked one."""
    extra = -states.shape[1] % ranks
    if extra == 0:
        return states, mask
    return (torch.nn.functional.pad(states, (0, 0, 0, extra)),
            torch.nn.functional.pad(mask, (0, extra), value=False))


class QwenImageVelocity:
    """v(x_s, sigma, {"prompt_index": [B]}) of a QwenImageTransformer2DModel through a `QwenPromptTable`."""

    def __init__(self, model: nn.Module, table):
        self.model, self.table = model, table

    def tokens(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The model's output in the packed layout [B, (H/2)(W/2), 4C]."""
        if set(cond) != {INDEX_KEY}:
            raise ValueError(f"QwenImageVelocity takes the conditioning {{{INDEX_KEY!r}: [B] int64}}, got keys "
                             f"{sorted(cond)}")
        text = self.table.cond(cond[INDEX_KEY])
        states, mask = _padded(text["encoder_hidden_states"], text["encoder_hidden_states_mask"],
                               _sequence_ranks(self.model))
        batch, _, height, width = x_s.shape
        return self.model(hidden_states=pack(x_s), timestep=sigma.to(x_s.dtype),
                          encoder_hidden_states=states.to(device=x_s.device, dtype=x_s.dtype),
                          encoder_hidden_states_mask=mask.to(x_s.device),
                          img_shapes=[[(1, height // 2, width // 2)]] * batch, return_dict=False)[0]

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return unpack(self.tokens(x_s, sigma, cond), *x_s.shape[-2:])

    def guided(self, scale: float, neg_cond: Cond) -> VelocityFn:
        """QwenImagePipeline's true CFG at `scale` over `neg_cond`, norm-rescaled per token (`dmd2.model.guided`);
        both branches in one batched forward."""
        def true_cfg(x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
            both = self.tokens(torch.cat([x_s, x_s]), torch.cat([sigma, sigma]), cat_cond(cond, neg_cond))
            v_pos, v_neg = both.chunk(2)
            comb = v_neg + scale * (v_pos - v_neg)
            comb = comb * (torch.norm(v_pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            return unpack(comb, *x_s.shape[-2:])

        return true_cfg

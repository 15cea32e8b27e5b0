"""Wan 2.2 A14B's two experts as one model: `transformer` denoises high noise, `transformer_2` low noise.

WanPipeline switches at the timestep `boundary_ratio * num_train_timesteps`: `transformer` for t >= it,
`transformer_2` below (diffusers `WanPipeline.__call__`). Here the switch is per sample, so one batch may hold
both (a rollout's samples stop at different sigmas; the critic draws a sigma per sample): each row goes to the
expert of its own timestep, so the pair is one velocity model for the algorithm, a teacher, a critic or a student.
"""

import torch
from torch import Tensor, nn


class WanExperts(nn.Module):
    """`forward(hidden_states, timestep, encoder_hidden_states, ...)` as a WanTransformer3DModel's, each sample
    answered by the expert of its timestep: `transformer` where t >= boundary, `transformer_2` below."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float,
                 num_train_timesteps: int = 1000):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_ratio = boundary_ratio
        self.boundary_timestep = boundary_ratio * num_train_timesteps
        self.config = transformer.config  # what callers read of a transformer (in_channels, patch_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def high_noise(self, timestep: Tensor) -> Tensor:
        """[B] bool: the samples `transformer` answers (the pipeline's `t >= boundary_timestep`)."""
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                return_dict: bool = False, **kwargs) -> tuple[Tensor]:
        high = self.high_noise(timestep)
        if bool(high.all()):  # one expert for the whole batch: a single call, as the pipeline makes
            return (self.transformer(hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0],)
        if not bool(high.any()):
            return (self.transformer_2(hidden_states, timestep, encoder_hidden_states, return_dict=False,
                                       **kwargs)[0],)
        out = torch.empty_like(hidden_states)
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            index = rows.nonzero().squeeze(1)
            out[index] = expert(hidden_states[index], timestep[index], encoder_hidden_states[index],
                                return_dict=False, **kwargs)[0].to(out.dtype)
        return (out,)


def load_wan_model(path: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The pipeline's WanTransformer3DModel, or for Wan 2.2 A14B both experts as one `WanExperts`, in `dtype`
    (None: float32), each weight read straight into it (`low_cpu_mem_usage`, as `dmd2.model.load_pretrained`)."""
    from diffusers import WanTransformer3DModel  # slow to import; only model loading needs it

    from dmd2.families.wan.pipeline import experts

    names, boundary = experts(path)
    loaded = [WanTransformer3DModel.from_pretrained(str(path), subfolder=name, dtype=dtype or torch.float32,
                                                    low_cpu_mem_usage=True, use_safetensors=True) for name in names]
    return loaded[0] if boundary is None else WanExperts(*loaded, boundary)


def wan_on_meta(path: str, dtype: torch.dtype | None = None) -> nn.Module:
    """`load_wan_model`'s architecture on the meta device, from the configs alone (`dmd2 plan`)."""
    from dmd2.families.wan.pipeline import experts
    from dmd2.model import architecture

    names, boundary = experts(path)
    built = [architecture(path, dtype, subfolder=name) for name in names]
    return built[0] if boundary is None else WanExperts(*built, boundary)

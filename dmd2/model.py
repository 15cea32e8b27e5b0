"""One call for every model: velocity for (x_s, sigma, cond).

The algorithm only ever sees a `VelocityFn`; tests pass lambdas or tiny modules, the trainer passes a
`DiffusersVelocity` over a diffusers model (UNet2DModel, SD3Transformer2DModel, ...). Conditioning is a
dict of per-sample tensors (batched along dim 0) handed to the model as keyword arguments, e.g.
`{"class_labels": [B]}` for the digits UNet or `{"encoder_hidden_states": ..., "pooled_projections": ...}`
for a text-to-image transformer.
"""

import inspect
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from dmd2.schedule import cfg, timestep

Cond = dict[str, Tensor]
VelocityFn = Callable[[Tensor, Tensor, Cond], Tensor]


class DiffusersVelocity:
    """Adapter: `v = model(x_s, t=1000*sigma, **cond)` for a diffusers model that predicts velocity.

    diffusers names the noisy input `sample` (UNets) or `hidden_states` (transformers); the adapter
    reads the name from the model's forward signature so the same code serves both.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        wrapped = getattr(model, "module", model)  # DDP and FSDP wrappers forward **kwargs unchanged
        self._input_name = next(iter(inspect.signature(wrapped.forward).parameters))

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        t = timestep(sigma).to(x_s.dtype)
        return self.model(**{self._input_name: x_s}, timestep=t, **cond, return_dict=False)[0]


class HostCalls:
    """A velocity fn whose model lives on ``device``, called with host tensors: for the evaluators,
    whose samplers and statistics are host code. Stages never use it: their tensors live on the device."""

    def __init__(self, velocity: VelocityFn, device: torch.device):
        self.velocity, self.device = velocity, device

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        if self.device.type == "cpu":
            return self.velocity(x_s, sigma, cond)
        cond = {k: v.to(self.device) for k, v in cond.items()}
        return self.velocity(x_s.to(self.device), sigma.to(self.device), cond).to(x_s.device)

    @property
    def guided(self):
        """The wrapped velocity's own guidance (`guided`), kept on the device; None: plain CFG around this."""
        own = getattr(self.velocity, "guided", None)
        return own and (lambda scale, neg_cond: HostCalls(own(scale, neg_cond), self.device))


def load_pretrained(path: str, dtype: torch.dtype | None = None) -> nn.Module:
    """A diffusers model from a `save_pretrained` directory (or a hub id the machine can reach), in `dtype`.

    `dtype` None keeps diffusers' default, torch's default dtype (fp32). The model is built on the meta
    device and each weight goes from the (memory-mapped) safetensors straight into a tensor of `dtype`
    (`low_cpu_mem_usage`, through accelerate), so a rank never holds a full fp32 copy on the host to
    cast afterwards. Weights that need no cast may stay in the file mapping: `own_storage` gives them
    storages of their own before they are offloaded (infra/trainers/offload.py).

    Only safetensors weights are read (`use_safetensors`): a directory may come from a shared store, and
    pickled weights (`.bin`) can run code when loaded, so a directory holding only those is refused.
    """
    from diffusers import AutoModel  # slow to import; only model loading needs it

    _refuse_pickled_only(Path(path))
    return AutoModel.from_pretrained(str(path), low_cpu_mem_usage=True, torch_dtype=dtype, use_safetensors=True)


def architecture(path: str, dtype: torch.dtype | None = None, subfolder: str | None = None) -> nn.Module:
    """The diffusers model of a `save_pretrained` directory (or hub id), built from its `config.json` alone on the
    meta device, in `dtype`: no weight is read. What `dmd2 plan` measures (infra/trainers/memory_plan.py)."""
    import diffusers  # slow to import; only model building needs it

    config = diffusers.AutoModel.load_config(str(path), subfolder=subfolder)
    return on_meta(getattr(diffusers, config["_class_name"]), config, dtype)


def on_meta(model_class: type, config: dict, dtype: torch.dtype | None = None) -> nn.Module:
    """``model_class.from_config(config)`` on the meta device, in ``dtype`` (None: fp32)."""
    with torch.device("meta"):
        model = model_class.from_config(config)
    return model.to(dtype) if dtype is not None else model


_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _refuse_pickled_only(folder: Path) -> None:
    """An `OSError` saying what to do if `folder` holds pickled weights and no safetensors (else nothing)."""
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(path.name for pattern in _PICKLED_WEIGHTS for path in folder.glob(pattern))
    if pickled:
        raise OSError(f"{folder} holds pickled weights ({', '.join(pickled)}) and no safetensors; only safetensors "
                      "are loaded (unpickling can run code): save the model with save_pretrained(dir, "
                      "safe_serialization=True)")


def guided(velocity_fn: VelocityFn, scale: float, neg_cond: Cond) -> VelocityFn:
    """CFG over `neg_cond` (`v = v_neg + w (v_pos - v_neg)`), both branches in one batched forward.

    With scale 1 the negative branch cannot change the result, so it is not computed. A velocity fn whose model takes
    guidance its own way (FLUX.1 [dev]'s guidance input, Qwen-Image's CFG with norm rescaling) says how with a method
    `guided(scale, neg_cond) -> VelocityFn`, which wrappers (`HostCalls`, `dmd2.precision.Autocast`) pass on.
    """
    if scale == 1.0:
        return velocity_fn
    if (own := getattr(velocity_fn, "guided", None)) is not None:
        return own(scale, neg_cond)

    def guided_fn(x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        both = velocity_fn(torch.cat([x_s, x_s]), torch.cat([sigma, sigma]), cat_cond(cond, neg_cond))
        v_pos, v_neg = both.chunk(2)
        return cfg(v_pos, v_neg, scale)

    return guided_fn


def cond_rows(cond: Cond, rows: Tensor | slice) -> Cond:
    """The conditioning of a subset of samples."""
    return {key: value[rows] for key, value in cond.items()}


def cat_cond(first: Cond, second: Cond) -> Cond:
    """Concatenate two conditionings sample-wise; both must have the same keys."""
    if first.keys() != second.keys():
        raise ValueError(f"cannot batch conds with keys {sorted(first)} and {sorted(second)}")
    return {key: torch.cat([first[key], second[key]]) for key in first}

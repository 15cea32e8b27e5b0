"""A trainer group's checkpoint folder: model, optimizer, lr schedule, RNG states, step counters.

Layout of one checkpoint (stored with `ArtifactStore.put_dir`, so it becomes visible atomically):

    model/                  the trained model, `save_pretrained` (loadable by diffusers as usual)
    optimizer.safetensors   per-parameter optimizer state, ``state.<param index>.<name>``
    optimizer.json          param_groups and any non-tensor state
    scheduler.json          the lr scheduler's state_dict
    rng/rank-<r>.safetensors  each rank's torch RNG states (CPU, and CUDA where present)
    checkpoint.json         role, step, world size, step counters, linked checkpoints

Only safetensors and JSON are written, so loading never unpickles anything.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

INFO_NAME = "checkpoint.json"


def rng_state() -> dict[str, Tensor]:
    """This process's torch RNG states."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_state(states: dict[str, Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, other = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                other[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "other_state": other}


def _optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value.clone()
    for key, value in meta["other_state"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [{**group, "betas": tuple(group["betas"])} if "betas" in group else group
              for group in meta["param_groups"]]  # JSON made the tuple a list
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def write_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, rng_states: list[dict[str, Tensor]],
                info: dict[str, Any]) -> None:
    """Write a checkpoint into the empty local ``folder`` (``model`` unwrapped: a diffusers model)."""
    model.save_pretrained(folder / "model", safe_serialization=True)
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "optimizer.json").write_text(json.dumps(meta, sort_keys=True))
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (folder / "scheduler.json").write_text(json.dumps(sched, sort_keys=True))
    (folder / "rng").mkdir()
    for rank, states in enumerate(rng_states):
        save_file({k: v.contiguous() for k, v in states.items()}, str(folder / "rng" / f"rank-{rank}.safetensors"))
    (folder / INFO_NAME).write_text(json.dumps(info, sort_keys=True, indent=1))


def read_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int) -> dict[str, Any]:
    """Load a checkpoint written by `write_state` in place; returns its ``checkpoint.json``.

    The RNG state of ``rank`` is restored when the checkpoint has one (same or larger world size).
    """
    weights: dict[str, Tensor] = {}
    for path in sorted((folder / "model").glob("*.safetensors")):
        weights.update(load_file(str(path)))
    model.load_state_dict(weights, strict=True)
    meta = json.loads((folder / "optimizer.json").read_text())
    optimizer.load_state_dict(_optimizer_state(load_file(str(folder / "optimizer.safetensors")), meta))
    sched = json.loads((folder / "scheduler.json").read_text())
    scheduler.load_state_dict(sched | {"lr_lambdas": [None] * len(optimizer.param_groups)})
    rng_path = folder / "rng" / f"rank-{rank}.safetensors"
    if rng_path.exists():
        set_rng_state(load_file(str(rng_path)))
    return json.loads((folder / INFO_NAME).read_text())

"""A trainer group's checkpoint: sharded model and optimizer state, lr schedule, RNG states, step counters.

A checkpoint of step n is rank 0's directory ``<run_id>/<checkpoint_dir>/<n>`` plus one directory
``<n>-rank-<r>`` per other rank that wrote shards. Every rank stores its own part (ranks may be on
different machines); rank 0 stores its directory last, naming the others' refs in
``checkpoint.json``, so a checkpoint becomes visible (its manifest lands) only when all of it is.

Rank 0's directory:

    __0_0.distcp, dcp_metadata.json, param_groups.json   model, optimizer and the student's EMA if it has one
                                                          (`infra.trainers.sharded`: keyed by parameter
                                                          name, reshardable)
    scheduler.json          the lr scheduler's state_dict
    rng/rank-<r>.safetensors  each rank's torch RNG states (CPU, and CUDA where present)
    checkpoint.json         role, step, world size, step counters, linked checkpoints, the other ranks' parts,
                            whether it holds an EMA

Only safetensors and JSON are written, so loading never unpickles anything. To load, every rank reads rank
0's JSON and RNG files, and only the data files its own load plan names (`load_checkpoint`): at the world
size and layout of the save, its own part and rank 0's file of the tensors every rank holds whole.
"""

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from dmd2.ema import ParameterEMA
from dmd2.failures import NonFiniteError
from dmd2.tensors import non_finite
from infra.store import ArtifactRef, ArtifactStore
from infra.store import keys as store_keys
from infra.trainers.collective import on_every_rank
from infra.trainers.offload import local
from infra.trainers.sharded import DATA_SUFFIX, load_sharded, save_sharded

INFO_NAME = "checkpoint.json"


def checkpoint_key(run_id: str, checkpoint_dir: str, step: int) -> str:
    """``<run_id>/<checkpoint_dir>/<step>``: the actor's default dir gives the store's `checkpoint_key`."""
    return store_keys.validate_key(f"{run_id}/{checkpoint_dir}/{int(step)}")


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


def write_rank0_files(folder: Path, scheduler: torch.optim.lr_scheduler.LRScheduler,
                      rng_states: list[dict[str, Tensor]], info: dict[str, Any]) -> None:
    """Add what only rank 0 writes (schedule, every rank's RNG, ``checkpoint.json``) to its ``folder``."""
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (folder / "scheduler.json").write_text(json.dumps(sched, sort_keys=True))
    (folder / "rng").mkdir()
    for rank, states in enumerate(rng_states):
        save_file({k: v.contiguous() for k, v in states.items()}, str(folder / "rng" / f"rank-{rank}.safetensors"))
    (folder / INFO_NAME).write_text(json.dumps(info, sort_keys=True, indent=1))


def read_info(folder: Path) -> dict[str, Any]:
    return json.loads((folder / INFO_NAME).read_text())


def read_rank_files(folder: Path, scheduler: torch.optim.lr_scheduler.LRScheduler, num_groups: int,
                    rank: int) -> None:
    """Restore the lr schedule and, when the checkpoint has one for ``rank``, its RNG states."""
    sched = json.loads((folder / "scheduler.json").read_text())
    scheduler.load_state_dict(sched | {"lr_lambdas": [None] * num_groups})
    rng_path = folder / "rng" / f"rank-{rank}.safetensors"
    if rng_path.exists():
        set_rng_state(load_file(str(rng_path)))


def save_checkpoint(store: ArtifactStore, key: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, rng_states: list[dict[str, Tensor]],
                    info: dict[str, Any], objects: dist.ProcessGroup | None,
                    ema: ParameterEMA | None = None) -> ArtifactRef | None:
    """Every rank stores its part; rank 0 stores its directory at ``key`` last and returns its ref (None
    on other ranks). ``objects``: the process group that carries Python objects between ranks; ``ema``:
    the model's EMA, stored beside it (``checkpoint.json`` says whether there is one).

    Nothing is written if any rank's weights or optimizer state hold a NaN or an infinity. What an earlier
    attempt at this step left (a part, or a directory nothing links to: the attempt died before rank 0's
    directory landed) is discarded first; a failed write fails every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    own_key = key if rank == 0 else store_keys.part_key(key, rank)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"

        def prepare() -> None:
            problem = _non_finite_state(model, optimizer, ema)  # the optimizer step's guard makes this rare
            if problem:
                raise NonFiniteError(f"the checkpoint {store.uri(key)} was not written: {problem}")
            store.discard_dir(own_key)

        on_every_rank(prepare, objects)
        # Each rank its own shards (DCP fails every rank alike).
        save_sharded(folder, model, optimizer, ema.state_dict() if ema is not None else None)
        part = on_every_rank(lambda: store.put_dir(own_key, folder) if rank != 0 and any(folder.iterdir()) else None,
                             objects)
        parts: list[Any] = [None] * world_size
        dist.all_gather_object(parts, part, group=objects)  # every part is stored before rank 0's directory
        if rank != 0:
            return None
        info = info | {"parts": {str(r): ref.to_dict() for r, ref in enumerate(parts) if ref is not None},
                       "ema": ema is not None}
        write_rank0_files(folder, scheduler, rng_states, info)
        return store.put_dir(key, folder)


def _non_finite_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: ParameterEMA | None) -> str | None:
    """This rank's first weight, optimizer-state or EMA tensor holding a NaN or an infinity, described."""
    names = {param: name for name, param in model.named_parameters()}
    named = [(name, local(param)) for param, name in names.items()]
    named += [(f"optimizer {key} of {names.get(param, '?')}", local(value))
              for param, state in optimizer.state.items() for key, value in state.items() if isinstance(value, Tensor)]
    named += [(f"EMA of {name}", local(value)) for name, value in (ema.state_dict() if ema else {}).items()]
    return non_finite(named)


def load_checkpoint(store: ArtifactStore, checkpoint: ArtifactRef, role: str, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                    rank: int, ema: ParameterEMA | None = None) -> dict[str, Any]:
    """Load a checkpoint of ``role`` in place (every rank calls, at any world size); returns its info.

    ``ema`` loads the checkpoint's EMA; a checkpoint saved without one (the run turned `[student]
    ema_decay` on later) restarts it at the loaded weights."""
    with tempfile.TemporaryDirectory() as tmp:
        names = store.list_dir(checkpoint)
        small = [name for name in names if not name.endswith(DATA_SUFFIX)]
        folder = store.get_dir(checkpoint, Path(tmp) / "checkpoint", paths=small)
        info = read_info(folder)
        if info["role"] != role:
            raise ValueError(f"{checkpoint.uri} is a {info['role']!r} checkpoint; load it into the "
                             f"{info['role']} group, not the {role} group")
        holders = {name: checkpoint for name in names if name.endswith(DATA_SUFFIX)}
        for part in (ArtifactRef.from_dict(part) for part in info["parts"].values()):
            holders.update({name: part for name in store.list_dir(part)})

        def fetch(name: str) -> None:  # a data file this rank's load plan names, verified, into `folder`
            if name not in holders:
                raise FileNotFoundError(f"the checkpoint {checkpoint.uri} lacks {name}, which its metadata names")
            fetched = store.get_dir(holders[name], Path(tmp) / f"fetched-{name}", paths=[name])
            (fetched / name).rename(folder / name)

        saved_ema = ema is not None and info.get("ema", False)
        load_sharded(folder, model, optimizer, ema.state_dict() if saved_ema else None, fetch)
        if ema is not None and not saved_ema:
            ema.reset()
        read_rank_files(folder, scheduler, len(optimizer.param_groups), rank)
    return info

"""Sharded checkpoints of a model and its optimizer with torch.distributed.checkpoint (DCP), pickle-free.

Every rank writes only its own shards into its own local folder; to load, every rank is given one
local folder with rank 0's metadata and a way to `fetch` each data file into it as its load plan needs
it (`infra.trainers.checkpoint` fetches from the store), so a rank reads only the files that hold what it
loads. DCP reshards on load, so a checkpoint written at one world size or layout (FSDP2 `fully_shard`, DDP,
a plain module) loads at another: state is keyed by parameter name (FQN), not by rank or position.

One checkpoint, the union of the ranks' folders:

    __<r>_0.distcp      rank r's tensor shards (every rank), a safetensors file despite DCP's suffix.
                        Keys are DCP's flattened FQNs, `model.<param>` and `optim.state.<param>.<name>`
                        (AdamW: step, exp_avg, exp_avg_sq), and `ema.<param>` for a model with an EMA
                        (`dmd2.ema`). A model with frozen parameters (LoRA, `dmd2.lora`) stores only
                        those that train.
    __0_1.distcp        (rank 0, when it also holds shards) the tensors every rank holds whole (FSDP2's
                        AdamW steps, buffers), written once, by rank 0: a rank loads them without reading
                        rank 0's shards. Under DDP every tensor is whole: rank 0 writes them all.
    dcp_metadata.json   (rank 0) DCP's `Metadata` as JSON: each tensor's global size, dtype, chunks and
                        the file holding each chunk.
    param_groups.json   (rank 0) the optimizer's param_groups (lr, betas, ...), params named by FQN.

DCP's own `FileSystemWriter` pickles its metadata and `torch.save`s every item (its reader unpickles
them, with `weights_only=True`); here only tensors go through DCP, its metadata is JSON and its data
files are safetensors read with `safe_open`, so loading never unpickles anything.
"""

import hashlib
import json
import queue
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, SerializationFormat, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor
from torch.futures import Future

METADATA_NAME = "dcp_metadata.json"
DATA_SUFFIX = DEFAULT_SUFFIX  # DCP's name for its data files (here safetensors)
PARAM_GROUPS_NAME = "param_groups.json"


def _torch_attr(name: str, kind: type) -> Any:
    """`torch.float32` from "torch.float32", refusing anything that is not a `kind`."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise ValueError(f"{METADATA_NAME}: {name!r} is not a {kind.__name__}")
    return value


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's `Metadata` (tensor entries only) as a JSON-able dict; `decode_metadata` inverts it."""
    tensors = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise TypeError(f"checkpoint entry {fqn!r} is {type(meta).__name__}, not a tensor: a sharded "
                            "checkpoint holds only tensors (non-tensor state belongs in a JSON file)")
        p = meta.properties
        tensors[fqn] = {"dtype": str(p.dtype), "layout": str(p.layout), "requires_grad": p.requires_grad,
                        "memory_format": str(p.memory_format), "pin_memory": p.pin_memory,
                        "size": list(meta.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
    storage = [{"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                "index": index.index, "file": info.relative_path, "file_offset": info.offset,
                "length": info.length, "transforms": info.transform_descriptors}
               for index, info in metadata.storage_data.items()]
    meta = metadata.storage_meta
    return {"version": metadata.version, "tensors": tensors, "storage": storage,
            "planner": None if metadata.planner_data is None
            else {key: list(path) for key, path in metadata.planner_data.items()},
            "storage_meta": None if meta is None else {
                "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)}}


def decode_metadata(data: dict[str, Any]) -> Metadata:
    tensors = {fqn: TensorStorageMetadata(
        properties=TensorProperties(dtype=_torch_attr(t["dtype"], torch.dtype),
                                    layout=_torch_attr(t["layout"], torch.layout),
                                    requires_grad=t["requires_grad"], pin_memory=t["pin_memory"],
                                    memory_format=_torch_attr(t["memory_format"], torch.memory_format)),
        size=torch.Size(t["size"]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t["chunks"]])
        for fqn, t in data["tensors"].items()}
    storage = {MetadataIndex(s["fqn"], s["offset"], s["index"]):
               _StorageInfo(s["file"], s["file_offset"], s["length"], s["transforms"]) for s in data["storage"]}
    meta = data["storage_meta"]
    return Metadata(state_dict_metadata=tensors, storage_data=storage, version=data["version"],
                    planner_data=None if data["planner"] is None
                    else {key: tuple(path) for key, path in data["planner"].items()},
                    storage_meta=None if meta is None else StorageMeta(**meta))


class JsonMetadataWriter(dcp.FileSystemWriter):
    """DCP's file writer with safetensors data files and JSON metadata (rank 0 calls `finish`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, serialization_format=SerializationFormat.SAFETENSORS, overwrite=False)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        # FileSystemWriter.write_data's one file per rank, but a rank holding shards and whole tensors
        # (FSDP2's rank 0) writes the whole ones apart: every rank loads those, only rank 0 its shards.
        shards = [item for item in plan.items if item.type == WriteItemType.SHARD]
        whole = [item for item in plan.items if item.type != WriteItemType.SHARD]
        files: queue.Queue = queue.Queue()
        for index, items in enumerate([shards, whole] if shards and whole else [plan.items]):
            name = f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        # FileSystemWriter.finish's bookkeeping, with JSON where it pickles.
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        # A safetensors file is keyed by FQN alone: a second chunk of one tensor in one file (2-D
        # sharding) would silently replace the first, so refuse it.
        seen = [(info.relative_path, index.fqn) for index, info in metadata.storage_data.items()]
        if len(set(seen)) != len(seen):
            raise ValueError("a rank holds two chunks of one tensor; this checkpoint format keeps one per rank")
        text = json.dumps(encode_metadata(metadata), sort_keys=True)
        staging = Path(self.path) / f"{METADATA_NAME}.tmp"
        staging.write_text(text)
        staging.rename(Path(self.path) / METADATA_NAME)  # a reader never sees half a metadata file


class JsonMetadataReader(dcp.FileSystemReader):
    """Reads what `JsonMetadataWriter` wrote: JSON metadata, safetensors data. `fetch(name)`, if given,
    brings the data file `name` into the folder when the load plan first needs it."""

    def __init__(self, path: Path, fetch: Callable[[str], None] | None = None) -> None:
        super().__init__(path)
        self._fetch = fetch

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = decode_metadata(json.loads((Path(self.path) / METADATA_NAME).read_text()))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # FileSystemReader.read_data would torch.load each item (it expects TORCH_SAVE files). A
        # safetensors data file holds each chunk under its FQN; read_item's offsets are within it.
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            if not (Path(self.path) / name).is_file() and self._fetch is not None:
                self._fetch(name)
            if not (Path(self.path) / name).is_file():
                raise FileNotFoundError(f"{self.path} lacks {name}: a load needs every saving rank's files")
            with safe_open(str(Path(self.path) / name), framework="pt") as file:
                for item in items:
                    region = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                    tensor = file.get_slice(item.storage_index.fqn)[region]
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise ValueError(f"{name}: {item.storage_index.fqn} has shape {tuple(tensor.size())}, "
                                         f"expected {tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _one_process() -> bool:
    """DCP runs without collectives: no process group, or a group of one rank (nothing to agree on).

    At one rank its planning collectives only cost, and on a CPU they cost every later step: the plan's
    gather (hundreds of KiB of pickled metadata) copies on a gloo thread, whose OpenMP team makes libgomp
    count more threads than cores and stop spinning between parallel regions; every training step after the
    first checkpoint then ran ~1.7x slower (issue 15's `make run`: 1.0 -> 1.35 s per rollout after rollout
    100). """
    return not dist.is_initialized() or dist.get_world_size() == 1


@contextmanager
def _dcp_call() -> Iterator[None]:
    # In one process (`_one_process`) DCP warns that it assumes one process; here that is the intended
    # case (a plain module, or a group of one rank), not an accident.
    with warnings.catch_warnings():
        if _one_process():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as error:
            # A BaseException, which `except Exception` (and Ray) would not take for an error: raise
            # the first failing rank's own exception, with every rank's report chained to it.
            raise error.failures[min(error.failures)][0] from error


def _trained_names(model: nn.Module) -> set[str] | None:
    """The names of the parameters that train when some are frozen (LoRA adapters, `dmd2.lora`), else None.

    Frozen weights are the init's, which a resuming rank loads anyway before the checkpoint: the
    checkpoint leaves them out, and the buffers with them (nothing trains those)."""
    params = list(getattr(model, "module", model).named_parameters())  # DDP's wrapper keeps the model in .module
    if all(param.requires_grad for _, param in params):
        return None
    return {name for name, param in params if param.requires_grad}


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer,
               ema: dict[str, Tensor] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """What goes through DCP (tensors by FQN) and the optimizer's param_groups (kept out of it)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    trained = _trained_names(model)
    if trained is not None:
        model_state = {key: value for key, value in model_state.items() if key in trained}
    state = {"model": model_state, "optim": {"state": optim_state["state"]}}
    if ema is not None:  # the EMA's own tensors: DCP loads into them in place
        state["ema"] = ema
    leaves = [(f"model.{k}", v) for k, v in model_state.items()] + [
        (f"optim.state.{p}.{k}", v) for p, values in optim_state["state"].items() for k, v in values.items()] + [
        (f"ema.{k}", v) for k, v in (ema or {}).items()]
    others = [key for key, value in leaves if not isinstance(value, Tensor)]
    if others:
        raise TypeError(f"non-tensor state {others[:5]}: a sharded checkpoint holds only tensors")
    return state, optim_state["param_groups"]


def save_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ema: dict[str, Tensor] | None = None) -> None:
    """Write this rank's part of a checkpoint of `model` and `optimizer` into its empty local `folder`.

    Collective: every rank of the default process group calls it (or one process without a group).
    `model` may be FSDP2-sharded, DDP-wrapped or plain. Rank r's folder holds only rank r's files.
    `ema`: the model's EMA by parameter name (`ParameterEMA.state_dict`), sharded like the model.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty; a sharded checkpoint is written into an empty folder")
    state, groups = _dcp_state(model, optimizer, ema)
    try:  # before any rank writes anything
        groups_text = json.dumps(groups, sort_keys=True)
    except TypeError as error:  # e.g. a tensor lr
        raise TypeError(f"optimizer param_groups must be JSON values: {error}") from error
    with _dcp_call():  # rank 0 writes the tensors every rank holds whole (see JsonMetadataWriter.write_data)
        dcp.save(state, storage_writer=JsonMetadataWriter(folder), no_dist=_one_process(),
                 planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (folder / PARAM_GROUPS_NAME).write_text(groups_text)


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ema: dict[str, Tensor] | None = None, fetch: Callable[[str], None] | None = None) -> None:
    """Load a checkpoint from `folder` in place: it holds rank 0's JSON files and every data file, or
    `fetch(name)` brings a data file (`__<r>_<i>.distcp`) into it when this rank's load needs it.

    Collective: every rank calls it, each with such a folder. The world size and layout may differ
    from the save's; the parameter names and the optimizer's param_groups must match. `ema` (saved
    with the checkpoint) is loaded into its tensors in place.
    """
    saved_groups = json.loads((folder / PARAM_GROUPS_NAME).read_text())
    state, groups = _dcp_state(model, optimizer, ema)
    if [g["params"] for g in saved_groups] != [g["params"] for g in groups]:
        raise ValueError(f"{folder}: the optimizer's param_groups hold other parameters than the saved ones")
    with _dcp_call():
        dcp.load(state, storage_reader=JsonMetadataReader(folder, fetch), no_dist=_one_process())
    # JSON turned tuples (AdamW's betas) into lists; give each value back the type the optimizer uses.
    saved_groups = [{k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in saved.items()}
                    for saved, now in zip(saved_groups, groups)]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": saved_groups},
                   options=StateDictOptions(strict=_trained_names(model) is None))  # frozen weights: not in it


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict[str, Tensor] | None = None) -> str:
    """sha256 of the whole weights, optimizer state and EMA, keyed by parameter name: the same under DDP
    and FSDP at any world size (bitwise comparisons in tests and checks). Collective under FSDP."""
    options = StateDictOptions(full_state_dict=True)
    tensors = dict(get_model_state_dict(model, options=options))
    if optimizer.state:  # asked of an optimizer without state, torch would make some (a step)
        for name, values in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
            tensors.update({f"optimizer.{name}.{key}": value for key, value in values.items()})
    for name, value in (ema or {}).items():  # whole tensors: gathering a DTensor's is a collective too
        tensors[f"ema.{name}"] = value.full_tensor() if isinstance(value, DTensor) else value
    digest = hashlib.sha256()
    for name in sorted(tensors):
        # A copy: exporting a tensor to numpy pins its storage's size for good, and sleep resizes it.
        tensor = tensors[name].detach().cpu().clone().reshape(-1)
        digest.update(name.encode() + tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

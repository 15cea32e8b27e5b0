"""Sharded DCP checkpoints (infra/trainers/sharded.py) at world sizes 1 and 2: gloo on CPU, real
torch.distributed processes (spawned), FSDP2 `fully_shard`, DDP and plain layouts.

Rank r of a save writes into `<root>/rank-<r>`, as a rank on its own machine would; `merged` builds
the one folder a load gets (the union of the ranks' files). Each check compares full tensors,
gathered after the load, bitwise with those gathered before the save.
"""

import json
import os
import pickle
import shutil
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dmd2.ema import ParameterEMA
from infra.trainers.sharded import (METADATA_NAME, PARAM_GROUPS_NAME, JsonMetadataWriter, decode_metadata,
                                    encode_metadata, load_sharded, save_sharded)


class Blocks(nn.Module):
    """Three linear blocks; odd widths make FSDP2's dim-0 shards uneven, `scale` is a replicated buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 9), nn.Linear(9, 3)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks[:-1]:
            x = torch.tanh(block(x))
        return self.blocks[-1](x) * self.scale


def make(layout: str, seed: int, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with its own random init, laid out as `plain`, `ddp` or `fsdp2`, and its AdamW."""
    torch.manual_seed(seed)
    model = Blocks()
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp":
        model = DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.1)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, ema: ParameterEMA | None = None) -> None:
    for step in steps:  # the same batch on every rank: the checks need no data-parallel sampling
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if ema is not None:
            ema.update()


EMA_DECAY = 0.7


def full_ema(ema: ParameterEMA) -> dict[str, Tensor]:
    """The EMA's whole tensors by parameter name (gathering a DTensor's is collective)."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in ema.state_dict().items()}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list[dict]]:
    """Model and optimizer state as full tensors by FQN (collective), and the param_groups."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    tensors = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    tensors |= {f"optim.{p}.{k}": v for p, values in optim.get("state", {}).items()
                for k, v in values.items()}  # empty off rank 0 (cpu_offload gathers to rank 0)
    return {k: v.detach().clone().contiguous() for k, v in tensors.items()}, optim.get("param_groups", [])


def write_full_state(model, optimizer, out: Path) -> None:
    tensors, groups = full_state(model, optimizer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file(tensors, str(out.with_suffix(".safetensors")))
        out.with_suffix(".json").write_text(json.dumps(groups))


def assert_same_state(found: tuple[dict, list], expected: tuple[dict, list]) -> None:
    assert sorted(found[0]) == sorted(expected[0])
    for key, value in expected[0].items():
        assert found[0][key].dtype == value.dtype and torch.equal(found[0][key], value), key
    assert json.loads(json.dumps(found[1])) == json.loads(json.dumps(expected[1]))  # tuples as lists


def read_full_state(out: Path) -> tuple[dict, list]:
    return load_file(str(out.with_suffix(".safetensors"))), json.loads(out.with_suffix(".json").read_text())


@contextmanager
def no_unpickling() -> Iterator[None]:
    """Make every unpickling entry point raise (pickle, torch.load) in this process while inside."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a sharded checkpoint load unpickled something")

    class ForbiddenUnpickler(pickle.Unpickler):  # still a class: a module imported meanwhile may subclass it
        __init__ = forbidden
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pickle, "Unpickler", ForbiddenUnpickler)
        for owner, name in [(pickle, "load"), (pickle, "loads"), (torch, "load"), (torch.serialization, "load")]:
            patch.setattr(owner, name, forbidden)
        yield


# -- rank jobs, run in every spawned rank ---------------------------------------------------------

def job_train_and_save(layout: str, root: Path, out: Path) -> None:
    model, optimizer = make(layout, seed=0)
    train(model, optimizer, range(2))
    save_sharded(root / f"rank-{dist.get_rank()}", model, optimizer)
    write_full_state(model, optimizer, out)


def job_load(layouts: list[str], folder: Path, out: Path) -> None:
    for layout in layouts:  # a fresh model of another init and lr each time: the load must set them all
        model, optimizer = make(layout, seed=1, lr=0.5)
        load_sharded(folder, model, optimizer)
        write_full_state(model, optimizer, out / layout)


def job_train_ema_and_save(root: Path, out: Path) -> None:
    """Two steps with an EMA, a checkpoint, a third step: where the resumed run must land."""
    model, optimizer = make("fsdp2", seed=0)
    ema = ParameterEMA(model, EMA_DECAY)
    train(model, optimizer, range(2), ema)
    save_sharded(root / f"rank-{dist.get_rank()}", model, optimizer, ema.state_dict())
    train(model, optimizer, range(2, 3), ema)
    averages = full_ema(ema)
    if dist.get_rank() == 0:
        save_file(averages, str(out))


def job_load_ema_and_continue(folder: Path, out: Path) -> None:
    model, optimizer = make("fsdp2", seed=1, lr=0.5)
    ema = ParameterEMA(model, EMA_DECAY)
    load_sharded(folder, model, optimizer, ema.state_dict())
    train(model, optimizer, range(2, 3), ema)
    averages = full_ema(ema)
    if dist.get_rank() == 0:
        save_file(averages, str(out))


def _rank_loop(rank: int, world: int, init: str, inbox, outbox) -> None:
    """One rank of `Ranks`: join the group once, then run each job sent until told to stop."""
    torch.set_num_threads(1)  # the ranks share the CPU
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # a job failing on one rank fails the other
    try:
        while (message := inbox.get()) is not None:
            job, args = message
            try:
                globals()[job](*args)
                outbox.put(None)
            except Exception:
                outbox.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # the interpreter's shutdown (torch and ray imported) takes seconds; nothing is left to flush


class Ranks:
    """Two processes joined by gloo for the whole module: starting them (importing torch and ray)
    costs seconds, a job on them a fraction of that."""

    def __init__(self, tmp: Path, world: int = 2) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.inboxes = [context.Queue() for _ in range(world)]
        self.outbox = context.Queue()
        self.processes = [context.Process(target=_rank_loop, daemon=True,
                                          args=(r, world, f"file://{tmp / 'init'}", self.inboxes[r], self.outbox))
                          for r in range(world)]
        for process in self.processes:
            process.start()

    def run(self, job: str, *args) -> None:
        """Run `job(*args)` (a function of this module) on every rank; raise what any rank raised."""
        for inbox in self.inboxes:
            inbox.put((job, args))
        errors = [e for e in (self.outbox.get(timeout=180) for _ in self.inboxes) if e is not None]
        assert not errors, "\n".join(errors)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


needs_ranks = pytest.mark.slow  # the spawned ranks take 10-20 s to start (each imports torch and ray)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Ranks:
    ranks = Ranks(tmp_path_factory.mktemp("ranks"))
    yield ranks
    ranks.close()


def merged(root: Path, union: Path) -> Path:
    """`union`, the folder a load gets: every rank's files in one (the store's download does this)."""
    union.mkdir()
    for folder in sorted(root.glob("rank-*")):
        for file in folder.iterdir():
            assert not (union / file.name).exists(), f"two ranks wrote {file.name}"
            shutil.copy(file, union / file.name)
    return union


@pytest.fixture(scope="module")
def fsdp2_saved(ranks, tmp_path_factory) -> tuple[Path, tuple[dict, list]]:
    """A checkpoint written by FSDP2 at world size 2, and the full state it was written from."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    ranks.run("job_train_and_save", "fsdp2", tmp / "ckpt", tmp / "expected")
    return tmp / "ckpt", read_full_state(tmp / "expected")


@needs_ranks
def test_each_rank_writes_only_its_own_shards(fsdp2_saved):
    root, _ = fsdp2_saved
    assert sorted(p.name for p in (root / "rank-0").iterdir()) == ["__0_0.distcp", "__0_1.distcp", METADATA_NAME,
                                                                    PARAM_GROUPS_NAME]
    assert sorted(p.name for p in (root / "rank-1").iterdir()) == ["__1_0.distcp"]
    with safe_open(str(root / "rank-0" / "__0_1.distcp"), framework="pt") as file:  # what every rank holds whole
        assert sorted(file.keys()) == ["model.scale"] + [f"optim.state.blocks.{b}.{p}.step" for b in range(3)
                                                         for p in ("bias", "weight")]
    shapes = []
    for rank in range(2):  # the data files are safetensors: FSDP2 splits a 7-row weight 4 + 3
        with safe_open(str(root / f"rank-{rank}" / f"__{rank}_0.distcp"), framework="pt") as file:
            shapes.append(file.get_slice("model.blocks.0.weight").get_shape())
    assert shapes == [[4, 5], [3, 5]]


@needs_ranks
def test_fsdp2_checkpoint_loads_into_fsdp2_and_ddp_at_world_2(ranks, fsdp2_saved, tmp_path):
    root, expected = fsdp2_saved
    ranks.run("job_load", ["fsdp2", "ddp"], merged(root, tmp_path / "all"), tmp_path)
    assert_same_state(read_full_state(tmp_path / "fsdp2"), expected)
    assert_same_state(read_full_state(tmp_path / "ddp"), expected)


@needs_ranks
def test_world_2_checkpoint_loads_into_one_plain_process_without_unpickling(fsdp2_saved, tmp_path):
    root, expected = fsdp2_saved
    folder = merged(root, tmp_path / "all")
    model, optimizer = make("plain", seed=1, lr=0.5)
    with no_unpickling():
        load_sharded(folder, model, optimizer)
    assert_same_state(full_state(model, optimizer), expected)


@needs_ranks
def test_world_1_checkpoint_loads_into_fsdp2_at_world_2(ranks, tmp_path):
    model, optimizer = make("plain", seed=0)
    train(model, optimizer, range(2))
    save_sharded(tmp_path / "ckpt" / "rank-0", model, optimizer)
    ranks.run("job_load", ["fsdp2"], merged(tmp_path / "ckpt", tmp_path / "all"), tmp_path)
    assert_same_state(read_full_state(tmp_path / "fsdp2"), full_state(model, optimizer))


@needs_ranks
def test_ddp_checkpoint_writes_replicas_once_and_loads_into_ddp_and_fsdp2(ranks, tmp_path):
    ranks.run("job_train_and_save", "ddp", tmp_path / "ckpt", tmp_path / "expected")
    keys = []
    for rank in range(2):
        with safe_open(str(tmp_path / "ckpt" / f"rank-{rank}" / f"__{rank}_0.distcp"), framework="pt") as file:
            keys += list(file.keys())
    expected = read_full_state(tmp_path / "expected")
    assert sorted(keys) == sorted(k.replace("optim.", "optim.state.", 1) for k in expected[0])  # each key once
    ranks.run("job_load", ["ddp", "fsdp2"], merged(tmp_path / "ckpt", tmp_path / "all"), tmp_path)
    assert_same_state(read_full_state(tmp_path / "ddp"), expected)
    assert_same_state(read_full_state(tmp_path / "fsdp2"), expected)


def test_a_resumed_run_takes_the_same_next_step(tmp_path):
    model, optimizer = make("plain", seed=0)
    train(model, optimizer, range(2))
    save_sharded(tmp_path, model, optimizer)
    train(model, optimizer, range(2, 3))
    resumed, resumed_optimizer = make("plain", seed=1, lr=0.5)
    with no_unpickling():
        load_sharded(tmp_path, resumed, resumed_optimizer)
    train(resumed, resumed_optimizer, range(2, 3))
    group = resumed_optimizer.param_groups[0]
    assert (group["lr"], group["betas"]) == (1e-2, (0.8, 0.95))  # the saved ones, tuple restored
    assert_same_state(full_state(resumed, resumed_optimizer), full_state(model, optimizer))


def test_a_resumed_run_continues_its_ema_bitwise(tmp_path):
    model, optimizer = make("plain", seed=0)
    ema = ParameterEMA(model, EMA_DECAY)
    train(model, optimizer, range(2), ema)
    save_sharded(tmp_path, model, optimizer, ema.state_dict())
    train(model, optimizer, range(2, 3), ema)
    resumed, resumed_optimizer = make("plain", seed=1, lr=0.5)
    resumed_ema = ParameterEMA(resumed, EMA_DECAY)
    with no_unpickling():
        load_sharded(tmp_path, resumed, resumed_optimizer, resumed_ema.state_dict())
    train(resumed, resumed_optimizer, range(2, 3), resumed_ema)
    assert sorted(resumed_ema.state_dict()) == sorted(name for name, _ in model.named_parameters())
    for name, value in ema.state_dict().items():
        assert torch.equal(resumed_ema.state_dict()[name], value), name
    assert not torch.equal(ema.state_dict()["blocks.0.weight"], model.blocks[0].weight)  # an average, not a copy
    load_sharded(tmp_path, *make("plain", seed=2))  # a run without an EMA ignores the checkpoint's


@needs_ranks
def test_an_fsdp2_run_resumed_from_its_checkpoint_continues_its_sharded_ema_bitwise(ranks, tmp_path):
    ranks.run("job_train_ema_and_save", tmp_path / "ckpt", tmp_path / "uninterrupted.safetensors")
    with safe_open(str(tmp_path / "ckpt" / "rank-1" / "__1_0.distcp"), framework="pt") as file:
        assert file.get_slice("ema.blocks.0.weight").get_shape() == [3, 5]  # rank 1's shard of the 7 rows
    ranks.run("job_load_ema_and_continue", merged(tmp_path / "ckpt", tmp_path / "all"),
              tmp_path / "resumed.safetensors")
    uninterrupted, resumed = (load_file(str(tmp_path / f"{name}.safetensors")) for name in ("uninterrupted", "resumed"))
    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) == 6
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_json_decodes_to_what_dcp_built(tmp_path):
    model, optimizer = make("plain", seed=0)
    train(model, optimizer, range(1))
    state = {"model": model.state_dict(), "optim": {"state": optimizer.state_dict()["state"]}}
    built = dcp.save(state, storage_writer=JsonMetadataWriter(tmp_path), no_dist=True)
    decoded = decode_metadata(json.loads((tmp_path / METADATA_NAME).read_text()))
    assert decoded.state_dict_metadata == built.state_dict_metadata
    assert decoded.storage_data == built.storage_data and decoded.planner_data == built.planner_data
    assert [k.index for k in decoded.storage_data] == [k.index for k in built.storage_data]
    assert (decoded.version, decoded.storage_meta.save_id) == (built.version, built.storage_meta.save_id)
    assert decoded.storage_meta.checkpoint_id == str(built.storage_meta.checkpoint_id)


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(TypeError, match="'step' is BytesStorageMetadata, not a tensor"):
        encode_metadata(Metadata(state_dict_metadata={"step": BytesStorageMetadata()}))
    model, optimizer = make("plain", seed=0)
    (tmp_path / "stale").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        save_sharded(tmp_path, model, optimizer)
    saved = tmp_path / "saved"
    train(model, optimizer, range(1))
    save_sharded(saved, model, optimizer)
    (saved / "__0_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match="lacks __0_0.distcp: a load needs every saving rank's files"):
        load_sharded(saved, model, optimizer)

"""A checkpoint's load through the store at world size 2 (infra/trainers/checkpoint.py): each rank fetches
rank 0's small files and only the data files its own load plan names. Two real processes joined by gloo on
CPU, FSDP2 `fully_shard`, a real file:// store; the store's reads are recorded, not replaced."""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from infra.store import ArtifactStore
from infra.trainers.checkpoint import load_checkpoint, rng_state, save_checkpoint
from tests.infra.trainers.test_sharded import assert_same_state, make, read_full_state, train, write_full_state

KEY = "run/checkpoints/2"


class RecordingStore(ArtifactStore):
    """The store, noting every file each `get_dir` fetches (folder key, file) in this process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetched: list[tuple[str, str]] = []

    def get_dir(self, ref, local_dir, paths=None):
        folder = ref.uri.removeprefix(self.root_uri + "/")
        self.fetched += [(folder, name) for name in (paths if paths is not None else self.list_dir(ref))]
        return super().get_dir(ref, local_dir, paths)


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _rank(rank: int, root: Path) -> None:
    """Save an FSDP2 checkpoint at world size 2, then load it into a fresh FSDP2 model of another init."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        store = RecordingStore((root / "store").as_uri())
        model, optimizer = make("fsdp2", seed=0)
        train(model, optimizer, range(2))
        ref = save_checkpoint(store, KEY, model, optimizer, _schedule(optimizer), [rng_state()] * 2,
                              {"role": "actor"}, None)
        write_full_state(model, optimizer, root / "saved")
        refs = [ref]
        dist.broadcast_object_list(refs, src=0)
        resumed, resumed_optimizer = make("fsdp2", seed=1, lr=0.5)
        load_checkpoint(store, refs[0], "actor", resumed, resumed_optimizer, _schedule(resumed_optimizer), rank)
        write_full_state(resumed, resumed_optimizer, root / "loaded")
        (root / f"fetched-{rank}.json").write_text(json.dumps(store.fetched))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks, each importing torch: ~15 s
def test_each_rank_fetches_only_the_parts_that_hold_what_it_loads(tmp_path):
    torch.multiprocessing.start_processes(_rank, args=(tmp_path,), nprocs=2, start_method="spawn")
    assert_same_state(read_full_state(tmp_path / "loaded"), read_full_state(tmp_path / "saved"))

    store = tmp_path / "store"
    assert sorted(os.listdir(store / KEY)) == ["MANIFEST.json", "__0_0.distcp", "__0_1.distcp", "checkpoint.json",
                                               "dcp_metadata.json", "param_groups.json", "rng", "scheduler.json"]
    assert sorted(os.listdir(store / f"{KEY}-rank-1")) == ["MANIFEST.json", "__1_0.distcp"]
    small = [(KEY, name) for name in ("checkpoint.json", "dcp_metadata.json", "param_groups.json",
                                      "rng/rank-0.safetensors", "rng/rank-1.safetensors", "scheduler.json")]
    whole = (KEY, "__0_1.distcp")  # the tensors every rank holds whole (AdamW's steps, the buffer)
    fetched = [sorted(map(tuple, json.loads((tmp_path / f"fetched-{rank}.json").read_text()))) for rank in (0, 1)]
    assert fetched[0] == sorted([*small, (KEY, "__0_0.distcp"), whole])
    assert fetched[1] == sorted([*small, (f"{KEY}-rank-1", "__1_0.distcp"), whole])

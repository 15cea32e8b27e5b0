"""Peak host memory while a rank loads a model in its training dtype: `load_pretrained` (diffusers'
`low_cpu_mem_usage` path) against diffusers' eager path (`low_cpu_mem_usage=False`) as the baseline,
measured in one run.

Each load runs in its own process, forked from one that has imported what a load needs (torch,
diffusers, the model's class) and done nothing else, and samples its /proc/self/status every millisecond while it
loads the model and gives it storages of its own (`own_storage`, as a rank does before it can
offload). The figure is the peak growth of RssAnon, the process's private memory: weights that need
no cast stay in the safetensors file mapping until `own_storage` copies them, so counting through it
charges every byte the rank ends up holding. The file mapping (RssFile, counted in ru_maxrss and
VmRSS too) is page cache, shared by the ranks of a node that read the same file and reclaimable: it
is printed beside the figure, not in it.

    python bench/loading.py [--model DIR] [--dir /tmp]

Without --model it measures a random-initialised UNet2DModel of 342 MiB in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run as a file, Python puts bench/ (not the repository) on sys.path; the loader lives in dmd2/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

MiB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# 89.5 M parameters: 342 MiB in fp32, large beside the fixed cost of a load (imports, module objects).
BENCH_UNET = dict(block_out_channels=(128, 256, 384, 512), layers_per_block=2)


@dataclass(frozen=True)
class LoadMemory:
    """One load's figures, in bytes: the peak growth of private memory, the model's weights in their
    dtype, and the peak growth of file-mapped memory (context only)."""

    dtype: str
    eager: bool
    peak: int
    model: int
    file_peak: int

    @property
    def ratio(self) -> float:
        return self.peak / self.model

    def line(self) -> str:
        way = "eager (baseline)" if self.eager else "load_pretrained "
        return (f"{way} {self.dtype}: peak host memory while loading: {self.peak / MiB:.0f} MiB for a "
                f"{self.model / MiB:.0f} MiB model in {self.dtype} (ratio {self.ratio:.2f}); file mapping "
                f"{self.file_peak / MiB:.0f} MiB at its peak")


# (dtype, eager): the new path in bf16, the eager path in bf16 as the baseline, the new path in fp32.
LOADS = (("bf16", False), ("bf16", True), ("fp32", False))


def save_bench_model(folder: Path) -> Path:
    """A random-initialised `BENCH_UNET` saved as safetensors in `folder`."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    UNet2DModel(**BENCH_UNET).save_pretrained(folder, safe_serialization=True)
    return folder


def measure(path: str | Path, loads=LOADS) -> list[LoadMemory]:
    """The figures of each `(dtype, eager)` load ("bf16" or "fp32") of the model at `path`.

    `eager` loads it the way `load_pretrained` did before (`low_cpu_mem_usage=False`), as the baseline.
    A fresh process imports everything once and forks a copy of itself for each load, so every load
    starts from the same state and the imports (seconds each) are paid once.
    """
    specs = [f"{dtype}:{'eager' if eager else 'lazy'}" for dtype, eager in loads]
    done = subprocess.run([sys.executable, __file__, "--child", str(path), *specs], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"measuring the loads of {path} failed:\n{done.stderr}")
    return [LoadMemory(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]


def _memory() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


def _sampled(load: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, int]]:
    """`load()`, and the peak growth of RssAnon and RssFile while it ran (sampled every millisecond)."""
    before = _memory()
    peak = dict(before)
    done = threading.Event()

    def sample() -> None:
        while True:
            last = done.is_set()  # read before sampling: the last sample is taken after the load returned
            for key, value in _memory().items():
                peak[key] = max(peak[key], value)
            if last:
                return
            done.wait(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = load()
    done.set()
    sampler.join()
    return model, {key: peak[key] - before[key] for key in peak}


def _child(path: str, specs: list[str]) -> None:
    """Print the figures of each load as a JSON line, each load in a fork of this process (see `measure`)."""
    # Imported before the forks, or the imports would count as the load's memory.
    import accelerate  # noqa: F401  (diffusers imports it inside the load)
    import diffusers

    from dmd2.model import load_pretrained
    from infra.trainers.offload import own_storage

    getattr(diffusers, json.loads((Path(path) / "config.json").read_text())["_class_name"])  # the model's module
    ways = {"lazy": load_pretrained,
            "eager": lambda path, dtype: diffusers.AutoModel.from_pretrained(path, low_cpu_mem_usage=False,
                                                                             torch_dtype=dtype)}
    for spec in specs:
        dtype, way = spec.split(":")
        sys.stdout.flush()  # or the fork would print this process's buffer again
        if os.fork() == 0:
            try:
                # own_storage as a rank does: weights left in the file mapping become private memory there.
                model, growth = _sampled(lambda: own_storage(ways[way](path, DTYPES[dtype])))
                model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
                print(json.dumps({"dtype": dtype, "eager": way == "eager", "peak": growth["RssAnon"],
                                  "model": model_bytes, "file_peak": growth["RssFile"]}), flush=True)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)  # a fork leaves at once: no atexit hooks or finalizers of the process it copied
        if os.wait()[1]:
            sys.exit(f"the {spec} load of {path} failed")


@dataclass(frozen=True)
class ShardedLoadMemory:
    """One rank's figures of a sharded load (`sharded_from_rank0`), in bytes: the peak growth of its private
    memory, the whole model's weights and the rank's own shards of them."""

    rank: int
    peak: int
    model: int
    shard: int
    every_rank: bool  # the baseline: every rank loads the whole model and shards it (`held_model`)

    def line(self) -> str:
        way = "every rank loads (baseline)" if self.every_rank else "sharded_from_rank0"
        return (f"{way}, rank {self.rank}: peak host memory while loading: {self.peak / MiB:.0f} MiB for a "
                f"{self.model / MiB:.0f} MiB model in fp32, of which the rank keeps {self.shard / MiB:.0f} MiB")


def measure_sharded(path: str | Path, world_size: int = 2, every_rank: bool = False) -> list[ShardedLoadMemory]:
    """Each rank's figures while ``world_size`` gloo ranks, one process each, load the model at ``path`` sharded
    with FSDP2 in fp32 (`infra.trainers.models.sharded_from_rank0`: rank 0 reads it, the others get shards; with
    ``every_rank``, the baseline: each rank loads the whole model and shards it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, "--sharded-child", str(path), str(rank), str(world_size),
                               str(port), str(int(every_rank))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world_size)]
    outputs = [process.communicate() for process in ranks]
    for process, (_, stderr) in zip(ranks, outputs):
        if process.returncode:
            raise RuntimeError(f"measuring the sharded load of {path} failed:\n{stderr}")
    return [ShardedLoadMemory(**json.loads(line)) for stdout, _ in outputs for line in stdout.splitlines()
            if line.startswith("{")]


def _sharded_child(path: str, rank: int, world_size: int, port: int, every_rank: bool) -> None:
    """One rank of `measure_sharded`: everything imported and the process group made first, then the load."""
    import torch.distributed as dist

    from dmd2.config import config_from_dict
    from dmd2.model import architecture, load_pretrained
    from infra.trainers.models import held_model, sharded_from_rank0
    from infra.trainers.offload import local, own_storage

    config = config_from_dict({"model": {"teacher": path}, "train": {"parallel": "fsdp", "world_size": world_size}})
    architecture(path)  # diffusers' model class imported before the measurement
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        def load() -> nn.Module:
            if every_rank:
                return held_model(own_storage(load_pretrained(path)), config)
            return sharded_from_rank0(lambda: own_storage(load_pretrained(path)), lambda: architecture(path), config,
                                      torch.device("cpu"))

        model, growth = _sampled(load)
        tensors = list(model.state_dict().values())
        print(json.dumps({"rank": rank, "peak": growth["RssAnon"],
                          "model": sum(t.numel() * t.element_size() for t in tensors),
                          "shard": sum(local(t).numel() * t.element_size() for t in tensors),
                          "every_rank": every_rank}), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a save_pretrained directory (default: a new "
                        "random UNet2DModel of 342 MiB in fp32)")
    parser.add_argument("--dir", default=None, help="folder for the new model (default: a temp folder)")
    parser.add_argument("--child", nargs="+", metavar="PATH SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--sharded-child", nargs=5, metavar="PATH RANK WORLD PORT EVERY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], args.child[1:])
    if args.sharded_child:
        path, rank, world_size, port, every_rank = args.sharded_child
        return _sharded_child(path, int(rank), int(world_size), int(port), every_rank == "1")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = args.model or save_bench_model(Path(folder))
        for load in [*measure(path), *measure_sharded(path, every_rank=True), *measure_sharded(path)]:
            print(load.line())


if __name__ == "__main__":
    main()

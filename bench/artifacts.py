"""Throughput of the artifact store on file:// against plain safetensors, measured in one run.

For a tensor dict of --size-mb MB it times, --repeats times each, like against like:

- put+fsync: ``ArtifactStore.put_tensors`` (safetensors' bytes, temp file, sha256, fsync, rename) against
  ``safetensors.torch.save_file`` followed by an fsync, each writing a new file: the store always
  fsyncs, so the baseline pays for durability too;
- get+read: ``ArtifactStore.get_tensors`` followed by reading every tensor (a clone) against
  ``safetensors.torch.load_file`` followed by the same: ``load_file`` only maps the file and reads
  nothing until a tensor is touched, while the store reads and hashes every byte before it
  returns, so both must touch every byte, as any consumer of the tensors does in the end.

It prints the median MB/s of each, the ratio store / safetensors (goal >= 0.8), and for context
only (not like for like) save_file without fsync, load_file without reading, safetensors'
private-memory loader (``safetensors.torch.load`` of the file's bytes, then the same read: private
memory as the store's get, but unverified), and the store's
digest alone (the plain sha256 of the object, on one core), which bounds any verified put or get.

    python bench/artifacts.py [--size-mb 64] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Run as a file, Python puts bench/ (not the repository) on sys.path; the store lives in infra/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from infra.store import ArtifactStore  # noqa: E402
from infra.store.io import sha256_hex  # noqa: E402

MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=64, help="total size of the tensor dict")
    parser.add_argument("--tensors", type=int, default=8, help="number of fp32 tensors in the dict")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is shown")
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp folder)")
    return parser.parse_args(argv)


def make_tensors(size_mb: int, count: int) -> dict[str, torch.Tensor]:
    numel = size_mb * MB // 4 // count
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(numel, generator=generator) for i in range(count)}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def save_file_durably(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """save_file, then fsync: the same durability as the store's put."""
    safetensors.torch.save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Touch every byte (a copy), so lazily mapped tensors are actually read."""
    return {name: tensor.clone() for name, tensor in tensors.items()}


def run_once(store: ArtifactStore, folder: Path, tensors: dict, index: int) -> dict[str, float]:
    """One timed round of every operation; returns seconds per operation."""
    durable, plain = folder / f"durable-{index}.safetensors", folder / f"plain-{index}.safetensors"
    key = store.rollout_key("bench", index, "tensors", 0)
    seconds = {"put+fsync/safetensors": timed(lambda: save_file_durably(tensors, durable))[0]}
    seconds["put+fsync/store"], ref = timed(lambda: store.put_tensors(key, tensors))
    load = safetensors.torch.load_file
    seconds["get+read/safetensors"] = timed(lambda: read_all(load(durable)))[0]
    seconds["get+read/store"] = timed(lambda: read_all(store.get_tensors(ref)))[0]
    seconds["save_file"] = timed(lambda: safetensors.torch.save_file(tensors, plain))[0]
    seconds["load_file"] = timed(lambda: load(durable))[0]
    from_bytes = safetensors.torch.load
    seconds["load_bytes"] = timed(lambda: read_all(from_bytes(durable.read_bytes())))[0]
    data = durable.read_bytes()
    seconds["digest"] = timed(lambda: sha256_hex(data))[0]
    durable.unlink()
    plain.unlink()
    store.prune("bench", keep_last=0)
    return seconds


def report(rounds: list[dict[str, float]], nbytes: int) -> None:
    def mbps(name: str) -> float:
        return nbytes / MB / statistics.median(r[name] for r in rounds)

    print(f"{nbytes / MB:.0f} MB tensor dict, file:// store, median of {len(rounds)} repeats")
    print("like for like (both fsync on put; both read every tensor on get); goal: ratio >= 0.8")
    for op in ("put+fsync", "get+read"):
        store_rate, plain_rate = mbps(f"{op}/store"), mbps(f"{op}/safetensors")
        print(
            f"{op:>9}: store {store_rate:9.1f} MB/s   safetensors {plain_rate:9.1f} MB/s   "
            f"ratio {store_rate / plain_rate:6.3f}"
        )
    print("context only, not like for like:")
    print(f"  save_file without fsync:   {mbps('save_file'):9.1f} MB/s")
    print(f"  load_file without reading: {mbps('load_file'):9.1f} MB/s (maps, reads nothing)")
    print(f"  load(bytes)+read:          {mbps('load_bytes'):9.1f} MB/s (private memory, unverified)")
    print(f"  store digest alone:        {mbps('digest'):9.1f} MB/s (sha256, one core; bounds a verified put/get)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tensors = make_tensors(args.size_mb, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        store = ArtifactStore(f"file://{folder}/store")
        run_once(store, Path(folder), tensors, index=0)  # warm-up: page cache, thread start-up
        rounds = [run_once(store, Path(folder), tensors, i) for i in range(1, args.repeats + 1)]
    report(rounds, nbytes)


if __name__ == "__main__":
    main()

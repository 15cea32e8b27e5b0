"""Every random number of a rollout, drawn so that it does not depend on how the batch is split.

A rollout's global batch holds M = world_size * K * B samples. Each sample's numbers of each stream
("noise", "stop", ...) come from a generator keyed by (seed, rollout id, stream name, sample index):
counter-based, so a rank draws only its own rows (O(its shard), not O(M)), world size 1 and world
size 2 see the same numbers for the same sample, resuming a run replays the same draws, and the
in-process loop and the orchestrated flow agree.
"""

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from dmd2.tensors import on_host

Device = torch.device | str


def seeded_generator(*keys: object) -> torch.Generator:
    """A CPU generator seeded by a stable hash of `keys` (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass(frozen=True)
class RolloutDraws:
    """Named random streams of one rollout, keyed per sample of its global batch of `global_size`."""

    seed: int
    rollout_id: int
    global_size: int

    def _generators(self, stream: str, rows: Tensor) -> list[torch.Generator]:
        rows = rows.tolist()  # sample indices: kept on the host (`shard_rows`), so no device sync here
        bad = [row for row in rows if not 0 <= row < self.global_size]
        if bad:
            raise IndexError(f"sample index {bad[0]} is outside the rollout's global batch of {self.global_size}")
        return [seeded_generator(self.seed, self.rollout_id, stream, row) for row in rows]

    # Drawn on the CPU (`on_host`) and moved once: the same numbers on every device, one host-to-device copy per draw.
    def normal(self, stream: str, rows: Tensor, sample_shape: tuple[int, ...], device: Device = "cpu") -> Tensor:
        """Standard normal noise of shape [len(rows), *sample_shape], on `device`."""
        with on_host():
            draws = [torch.randn(sample_shape, generator=g) for g in self._generators(stream, rows)]
            drawn = torch.stack(draws) if draws else torch.empty((0, *sample_shape))
        return drawn.to(device)

    def uniform(self, stream: str, rows: Tensor, device: Device = "cpu") -> Tensor:
        """U[0, 1) per row, shape [len(rows)], on `device`."""
        with on_host():
            drawn = torch.tensor([torch.rand((), generator=g).item() for g in self._generators(stream, rows)])
        return drawn.to(device)

    def integers(self, stream: str, high: int, rows: Tensor, device: Device = "cpu") -> Tensor:
        """Uniform integers in [0, high) per row, int64 [len(rows)], on `device`."""
        with on_host():
            drawn = torch.tensor([torch.randint(high, (), generator=g).item()
                                  for g in self._generators(stream, rows)], dtype=torch.int64)
        return drawn.to(device)


def shard_rows(rank: int, world_size: int, steps: int, batch: int) -> Tensor:
    """Global sample indices of a rank's shard, ordered so that local rows [j*B, (j+1)*B) are step j's.

    Step j's global batch is always samples [j*W*B, (j+1)*W*B), whatever the world size W: rank r takes
    [j*W*B + r*B, j*W*B + (r+1)*B). So a world of W ranks at B per rank trains on exactly the samples
    one rank at W*B would.
    """
    with on_host():
        step = torch.arange(steps).repeat_interleave(batch)
        within = torch.arange(batch).repeat(steps)
        return step * world_size * batch + rank * batch + within

"""`dmd2 plan`: each GPU's memory through a rollout, predicted before the run from the ranks' own code.

One GPU holds rank i of the critic group and rank i of the actor group (they share placement bundle i,
infra/trainers/cluster.py). A group sleeps after its stage (its weights, optimizer state and EMA parked in host
memory) and the critic's teacher is on the GPU only while it scores (infra/trainers/rank.py; under FSDP2 it is
sharded like the critic, `held_teacher`), so a stage's peak is what the awake group holds then. The plan rehearses
one rollout as the ranks run it, and then an evaluation and a checkpoint (infra/trainers/rehearsal.py): the
models are built from their configs on the meta device (no weight is read) and given fake storage (torch's
`FakeTensorMode`), held as `[train]` says (`infra.trainers.models`: LoRA adapters, the GAN head, recomputed
activations, FSDP2 over a fake process group of the world size), and the stages
run the product's code (backward simulation, the pairs, each group's `train_steps` with its hooks, the teacher's
scoring, the samplers) while `dmd2.memory.MemoryLedger` counts every live storage by category, and `FlopCount` each
training stage's floating-point operations (torch's own formulas over the operators' shapes). Nothing is computed,
so a plan of SD3.5 at 1024 px runs on a CPU. Of the critic's steps only the first and the last are rehearsed
(`rehearsed_steps`: the middle ones repeat the first's memory); its FLOPs are scaled to every step.

The optimizer state is made before the rollout (AdamW makes its moments at its first step): the plan is of a
rollout in the middle of a run. DDP at world size > 1 is planned as its memory (`DdpBuckets`: its reducer cannot
run on fake tensors), and under FSDP2 the block it gathers ahead (`gathered_ahead`). Not in the figures: the CUDA
context, NCCL's buffers and the allocator's fragmentation, for which a fit keeps `RESERVE` of each GPU free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmd2.config import TrainConfig
from dmd2.config_rules import SHARDED
from dmd2.family import RunSpec
from dmd2.memory import MemoryLedger, StagePeak, block_bytes
from infra.trainers.ddp_buckets import DdpBuckets
from infra.trainers.flops import FlopCount
from infra.trainers.offload import optimizer_tensors
from infra.trainers.parallel import mesh_shape, replicated
from infra.trainers.rehearsal import (DEVICE, STAGES, Parking, Wrap, gpu_models, rehearse, rehearse_outputs,
                                      rehearsed_steps)
from infra.trainers.sequence import sequence_mesh

# The group asleep in each stage (its DDP buckets are resident too with nothing asleep), and whose forwards it runs.
ASLEEP = {"rollout": "critic", "convert": "critic", "critic-train": "actor", "score": "actor", "actor-train": "critic",
          "reference": "critic", "evaluate": "critic", "checkpoint": None}
COMPUTING = {"rollout": ("actor",), "convert": (), "critic-train": ("critic",), "score": ("critic", "teacher"),
             "actor-train": ("actor",), "reference": ("teacher",), "evaluate": ("actor",), "checkpoint": ()}
RESERVE = 0.10  # of each GPU, for what the figures leave out (see the module docstring)
# A load's peak host memory over the bytes of the model it reads, at most (tests/dmd2/test_loading.py holds it).
LOAD_OVERHEAD = 1.2


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's predicted bytes in each stage of a rollout (`StagePeak`s, by category), the host memory its
    two ranks park while asleep, and the run's size."""

    world_size: int
    stages: tuple[StagePeak, ...]
    host_parked: int
    parameters: int  # the teacher's
    resident: int = 0  # the largest stage with nothing asleep: both groups and the teacher on the GPU (sleep = never)
    flops: dict[str, int] = dataclasses.field(default_factory=dict)  # per stage, one GPU, one whole rollout
    whole: dict[str, int] = dataclasses.field(default_factory=dict)  # each model's bytes, as a rank reads it whole

    @property
    def flops_per_rollout(self) -> int:
        """The floating-point operations one GPU computes in a rollout (torch's `FlopCounterMode`: matrix
        products, convolutions and attention, forward, backward and recomputation alike)."""
        return sum(self.flops.values())

    @property
    def peak(self) -> StagePeak:
        return max(self.stages, key=lambda stage: stage.peak)

    @property
    def host_rank_pair(self) -> int:
        """Bytes one GPU's two ranks take when their "GPU" is host memory (CPU ranks): what sleeps stays in the same
        memory, so the largest stage and everything parked meanwhile."""
        return self.peak.peak + self.host_parked

    def host_loading(self, gpus_per_node: int, sharded: bool) -> int:
        """The most host memory a node's ranks take while they load, every rank at once: each model (the critic's
        teacher too) is read whole by rank 0 of its group alone (FSDP2: the others receive their shards) or by every
        rank (DDP); each read at `LOAD_OVERHEAD` its bytes."""
        readers = 1 if sharded else gpus_per_node
        return int(LOAD_OVERHEAD * readers * sum(self.whole.values()))

    def host_export(self, sharded: bool) -> int:
        """The host memory rank 0 takes to export the student: under FSDP2 its state gathered there and the plain
        copy made of it (`StudentOutputs.export`), else the copy safetensors writes from the device."""
        return (2 if sharded else 1) * self.whole["actor"]

    def fits(self, gpu_bytes: int) -> bool:
        """Whether every stage leaves `RESERVE` of a GPU of ``gpu_bytes`` free."""
        return self.peak.peak <= (1 - RESERVE) * gpu_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPlan:
        return cls(data["world_size"], tuple(StagePeak(**stage) for stage in data["stages"]), data["host_parked"],
                   data["parameters"], data["resident"], data["flops"], data["whole"])


class LedgerParking(Parking):
    def __init__(self, ledger: MemoryLedger):
        self.ledger, self._parked = ledger, {}

    def park(self, name: str, tensors: list[Tensor]) -> None:
        self.ledger.park(tensors)
        self._parked[name] = tensors

    def unpark(self, name: str) -> None:
        self.ledger.unpark(self._parked.pop(name))


def plan_memory(spec: RunSpec) -> MemoryPlan:
    """The plan of one GPU of a run of ``spec`` at its `[train] world_size`, on fake tensors (see the module
    docstring); ``spec.family`` unbound (its `plan_bind` stands in for the prepared inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    config = spec.config
    with fake_world(config.train) as mesh:
        with FakeTensorMode(allow_non_fake_inputs=True):
            family = spec.family.plan_bind(config, DEVICE)
            bound = RunSpec(config, family, spec.sample_shape, spec.conds, spec.cache_dir, spec.prepared, spec.real)

            def load(path: str, dtype: torch.dtype | None) -> nn.Module:
                with unset_fake_temporarily():  # a module made inside the fake mode could not swap in fake storage
                    model = family.model_on_meta(path, dtype)
                return model.to_empty(device=DEVICE)

            ledger = MemoryLedger()
            gpu = gpu_models(bound, load, mesh, _labelled_buckets(ledger) if replicated(config) else None)
            with ledger:
                for state in (gpu.actor, gpu.critic):
                    ledger.label(state.model, "weights")
                    ledger.label(optimizer_tensors(state.optimizer), "optimizer")
                    ledger.label(state.ema.local_tensors() if state.ema is not None else [], "weights")  # the EMA
                ledger.label(gpu.teacher, "teacher")
                ledger.label(family.conditioning_tensors(), "conditioning")
                stages = _Stages(ledger)
                parking = LedgerParking(ledger)
                rehearse(gpu, stages.stage, parking)
                rehearse_outputs(gpu, stages.stage, parking)
    critic_steps = config.dmd2.critic_steps_per_rollout
    stages.flops["critic-train"] = stages.flops["critic-train"] * critic_steps // len(rehearsed_steps(critic_steps))
    parameters = sum(p.numel() for p in gpu.teacher.parameters())
    peaks = ledger.peaks
    computing = dict(COMPUTING, evaluate=COMPUTING["evaluate"] if family.splits_evaluation else ())  # else a copy
    if config.train.parallel in SHARDED:
        gathers = {name: gathered_ahead(module, torch.bfloat16 if config.train.mixed_precision == "bf16" else None)
                   for name, module in (("actor", gpu.module("actor")), ("critic", gpu.module("critic")),
                                        ("teacher", gpu.teacher))}
        peaks = [_with_temporaries(peak, max((gathers[name] for name in computing[peak.stage]), default=0))
                 for peak in peaks]
    # With nothing asleep (sleep = "never"), DDP's wrapper stays too: the asleep group's buckets are resident.
    buckets = {role: DdpBuckets.bytes_of(gpu.module(role)) if replicated(config) else 0 for role in ("actor", "critic")}
    buckets[None] = 0
    resident = max(peak.peak + stages.parked[peak.stage] + buckets[ASLEEP[peak.stage]] for peak in peaks)
    flops = {name: stages.flops[name] for name in STAGES}  # a rollout's: the outputs come now and then
    whole = {role: _whole_bytes(gpu.module(role)) for role in ("actor", "critic")}
    whole["teacher"] = _whole_bytes(gpu.teacher)
    return MemoryPlan(config.train.world_size, tuple(peaks), max(stages.parked.values()), parameters, resident, flops,
                      whole)


def _whole_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, whole (a DTensor's numel is the whole tensor's)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def gathered_ahead(model: nn.Module, dtype: torch.dtype | None) -> int:
    """The bytes of ``model``'s largest FSDP2 block gathered whole, in ``dtype`` (None: its own). On a GPU FSDP2
    gathers the next block while one computes (its all-gathers run on their own stream, and backward prefetches
    the block before), so a stage holds one more block's weights than a rehearsal whose collectives finish at
    once (a fake process group's)."""
    return max((block_bytes(sum(p.numel() * (dtype.itemsize if dtype and p.is_floating_point() else p.element_size())
                                for p in unit.parameters())) for unit in _blocks(model)), default=0)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one below the root (`fully_shard` made them `FSDPModule`s)."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]


def _with_temporaries(peak: StagePeak, extra: int) -> StagePeak:
    by_category = dict(peak.by_category)
    by_category["temporaries"] = by_category.get("temporaries", 0) + extra
    return StagePeak(peak.stage, peak.peak + extra, by_category)


def _labelled_buckets(ledger: MemoryLedger) -> Wrap:
    """`DdpBuckets`, their buffers counted as gradients."""
    def wrap(module: nn.Module) -> DdpBuckets:
        wrapped = DdpBuckets(module)
        ledger.label(wrapped.buckets, "gradients")
        return wrapped
    return wrap


class _Stages:
    """What the ledger does not keep of each stage: the bytes parked in host memory meanwhile (groups sleep and
    wake between stages, so what is parked is constant through one), and the FLOPs it computes (counted on the
    fake tensors: only their shapes matter)."""

    def __init__(self, ledger: MemoryLedger):
        self.ledger, self.parked, self.flops = ledger, {}, {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        parked, counter = self.ledger.parked, FlopCount()
        with self.ledger.stage(name), counter:
            yield
        self.parked[name] = parked
        self.flops[name] = counter.total


@contextmanager
def fake_world(train: TrainConfig) -> Iterator[object]:
    """A fake process group of `[train] world_size` ranks (this process is rank 0; collectives move no data) and
    the device mesh the ranks shard over (`mesh_shape`), made before any fake mode (a mesh cannot be made inside
    one); none where nothing needs it. Under `[train] sequence_parallel` the sequence mesh is made here too, for
    `gpu_models` to find (`sequence_mesh` keeps it per process group)."""
    sharded = train.parallel in SHARDED
    if not (sharded or train.sequence_parallel > 1) or dist.is_initialized():
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=train.world_size)
    try:
        sequence_mesh(train, "cpu")
        shape = mesh_shape(train)
        yield init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):]) if sharded else None
    finally:
        dist.destroy_process_group()


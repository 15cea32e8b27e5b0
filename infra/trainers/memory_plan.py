"""`dmd2 plan`: each GPU's memory through a rollout, predicted before the run from the ranks' own code.

One GPU holds rank i of the critic group and rank i of the actor group (they share placement bundle i,
infra/trainers/cluster.py). A group sleeps after its stage (its weights, optimizer state and EMA parked in host
memory) and the critic's teacher is on the GPU only while it scores (infra/trainers/rank.py), so a stage's peak
is what the awake group holds then. The plan rehearses one rollout as the ranks run it: the models are built
from their configs on the meta device (no weight is read) and given fake storage (torch's `FakeTensorMode`),
held as `[train]` says (`infra.trainers.models`: LoRA adapters, the GAN head, recomputed activations, FSDP2 over
a fake process group of the world size), and the stages run the product's code (backward simulation, the
pairs, each group's `train_steps` with its hooks, the teacher's scoring) while `dmd2.memory.MemoryLedger`
counts every live storage by category, and `FlopCount` each stage's floating-point operations (torch's own
formulas over the operators' shapes). Nothing is computed, so a plan of SD3.5 at 1024 px runs on a CPU. Of the
critic's steps only the first and the last are rehearsed (`rehearsed_steps`: the middle ones repeat the first's
memory); its FLOPs are scaled to every step.

The optimizer state is made before the rollout (AdamW makes its moments at its first step): the plan is of a
rollout in the middle of a run. DDP at world size > 1 is planned as its memory (`DdpBuckets`: its reducer cannot
run on fake tensors), and under FSDP2 the block it gathers ahead (`gathered_ahead`). Not in the figures: the CUDA
context, NCCL's buffers and the allocator's fragmentation, for which a fit keeps `RESERVE` of each GPU free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmd2.config import TrainConfig
from dmd2.config_rules import SHARDED
from dmd2.convert import samples_to_train_pairs
from dmd2.family import RunSpec
from dmd2.gan import tapped
from dmd2.hooks import score
from dmd2.memory import MemoryLedger, StagePeak, block_bytes
from dmd2.plan import rollout_plan
from dmd2.precision import teacher_dtype
from dmd2.rollout import rollout_shard
from dmd2.trainer import HookContext, Hooks, TrainState, train_state, train_steps
from infra.trainers.configs import compute_trainer_configs
from infra.trainers.ddp_buckets import DdpBuckets
from infra.trainers.hooks import resolve_hooks
from infra.trainers.models import held_model, rank_velocity, role_model
from infra.trainers.offload import module_tensors, optimizer_tensors, sleeping_tensors
from infra.trainers.flops import FlopCount
from infra.trainers.parallel import mesh_shape, replicated
from infra.trainers.sequence import sequence_mesh, split_sequence

STAGES = ("rollout", "convert", "critic-train", "score", "actor-train")
ASLEEP = {"rollout": "critic", "convert": "critic", "critic-train": "actor", "score": "actor", "actor-train": "critic"}
COMPUTING = {"rollout": ("actor",), "convert": (), "critic-train": ("critic",), "score": ("critic", "teacher"),
             "actor-train": ("actor",)}  # whose forwards each stage runs
RESERVE = 0.10  # of each GPU, for what the figures leave out (see the module docstring)
DEVICE = torch.device("cpu")  # fake storage on the CPU stands in for the GPU (fake CUDA fails inside FSDP2)
Load = Callable[[str, "torch.dtype | None"], nn.Module]  # (model path, dtype) -> the model on DEVICE


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

    def fits(self, gpu_bytes: int) -> bool:
        """Whether every stage leaves `RESERVE` of a GPU of ``gpu_bytes`` free."""
        return self.peak.peak <= (1 - RESERVE) * gpu_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPlan:
        return cls(data["world_size"], tuple(StagePeak(**stage) for stage in data["stages"]), data["host_parked"],
                   data["parameters"], data["resident"], data["flops"])


Wrap = Callable[[nn.Module], nn.Module]  # a replicated model -> what its optimizer steps run (DDP's wrapper)


@dataclass
class GpuModels:
    """What one GPU holds: rank i of each group (model, optimizer, EMA) and the critic's frozen teacher; a group's
    model is ``wrap``ped while it is awake, as a rank wraps a replicated model (DDP at world size > 1)."""

    spec: RunSpec
    actor: TrainState
    critic: TrainState
    teacher: nn.Module
    hooks: dict[str, Hooks]
    wrap: Wrap | None = None
    device: torch.device = DEVICE  # where the models are: the plan's fake CPU, or a real device (bench/gpu.py)
    asleep: set[str] = dataclasses.field(default_factory=set)  # roles, and "teacher" while it is parked

    def module(self, role: str) -> nn.Module:
        """The group's model unwrapped, which its forwards without grad run (the rollout, scoring)."""
        model = getattr(self, role).model
        return getattr(model, "module", model)

    def sleep(self, role: str, parking: Parking) -> None:
        """As the rank's sleep: gradients dropped, weights, optimizer state and EMA parked, the wrapper gone; the
        teacher parked. Nothing happens to what is asleep already (a rollout after the first finds the critic so)."""
        if role in self.asleep:
            return
        self.asleep.add(role)
        if role == "teacher":
            parking.park(role, module_tensors(self.teacher))
            return
        state, module = getattr(self, role), self.module(role)
        parking.park(role, sleeping_tensors(module, state))
        if isinstance(state.model, DdpBuckets):
            state.model.remove()
        self._hold(state, module)

    def wake(self, role: str, parking: Parking) -> None:
        """As the rank's wake: what sleeps restored, the model wrapped anew."""
        if role not in self.asleep:
            return
        self.asleep.remove(role)
        parking.unpark(role)
        if role == "teacher":
            return
        state = getattr(self, role)
        self._hold(state, self.wrap(state.model) if self.wrap is not None else state.model)

    def _hold(self, state: TrainState, model: nn.Module) -> None:
        module = getattr(model, "module", model)
        state.model = model
        state.velocity = tapped(rank_velocity(self.spec.family, model, self.spec.config, self.device), module)


def gpu_models(spec: RunSpec, load: Load, mesh=None, wrap: Wrap | None = None,
               device: torch.device = DEVICE) -> GpuModels:
    """Both groups' rank on one GPU, loaded by ``load`` and held as the ranks hold them, awake (``wrap``ped, if
    given); ``spec.family`` must be bound (`ModelFamily.bind`). Their optimizer state is made
    (`_with_optimizer_state`)."""
    config, family = spec.config, spec.family
    states, hooks, teacher = {}, {}, None
    sequence = sequence_mesh(config.train, device.type)  # `fake_world` made it, before the fake mode
    for trainer in compute_trainer_configs(config, "checkpoints"):
        model = held_model(role_model(load(trainer.init, None), family, trainer, config), config, mesh, sequence)
        state = train_state(model, trainer.lr, config, family.velocity, trainer.ema_decay, trainer.steps_per_rollout)
        states[trainer.role] = _with_optimizer_state(state)
        hooks[trainer.role] = resolve_hooks(trainer.hooks, trainer.role)
        if trainer.teacher is not None:
            teacher = split_sequence(load(trainer.teacher, teacher_dtype(config)), sequence)
            teacher = teacher.eval().requires_grad_(False)
    gpu = GpuModels(spec, states["actor"], states["critic"], teacher, hooks, wrap, device)
    for state in states.values():
        gpu._hold(state, wrap(state.model) if wrap is not None else state.model)
    return gpu


def _with_optimizer_state(state: TrainState) -> TrainState:
    """AdamW's moments, as after the run's first step: one step on zero gradients (weight decay aside, a no-op)."""
    for group in state.optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return state


class Parking:
    """Where a rehearsal parks what sleeps: in the ledger's host total (a plan), or for real (a measurement)."""

    def park(self, name: str, tensors: list[Tensor]) -> None:
        raise NotImplementedError

    def unpark(self, name: str) -> None:
        raise NotImplementedError


class LedgerParking(Parking):
    def __init__(self, ledger: MemoryLedger):
        self.ledger, self._parked = ledger, {}

    def park(self, name: str, tensors: list[Tensor]) -> None:
        self.ledger.park(tensors)
        self._parked[name] = tensors

    def unpark(self, name: str) -> None:
        self.ledger.unpark(self._parked.pop(name))


def rehearsed_steps(steps: int) -> list[int]:
    """Of a group's ``steps`` optimizer steps, the first and the last (which keeps what scoring needs): with the
    optimizer state made, every middle step repeats the first's memory (and FLOPs), and rehearsing them would
    only cost time."""
    return [0, steps - 1] if steps > 1 else [0]


def _first_and_last(hooks: Hooks, steps: int) -> tuple[Hooks, int]:
    """The hooks that run `rehearsed_steps` of ``steps``, and how many steps they are, for `train_steps`."""
    chosen = rehearsed_steps(steps)
    return dataclasses.replace(
        hooks, loss=lambda ctx, velocity, batch, step: hooks.loss(ctx, velocity, batch, chosen[step]),
        prepare=lambda ctx, pairs, step: hooks.prepare(ctx, pairs, chosen[step])), len(chosen)


def rehearse(gpu: GpuModels, stage: Callable[[str], AbstractContextManager], parking: Parking,
             every_step: bool = False) -> None:
    """One rollout on ``gpu`` as the two ranks run it, each of `STAGES` inside ``stage(name)``: the group of the
    stage awake (woken before it), the other asleep, the teacher on the device only while scoring. The critic
    runs `rehearsed_steps` of its steps, or with ``every_step`` all of them (a timed rollout)."""
    spec, device = gpu.spec, gpu.device
    config, family = spec.config, spec.family
    plan = rollout_plan(config, 0, spec.sample_shape)
    real = family.real_source(spec)
    gpu.sleep("critic", parking)
    gpu.sleep("teacher", parking)
    with stage("rollout"):
        student = rank_velocity(family, gpu.module("actor"), config, device)
        samples = rollout_shard(student, spec.conds, plan, 0, device, lockstep=config.train.parallel in SHARDED)
    with stage("convert"):
        pairs = samples_to_train_pairs(samples, config.student.num_steps)
    del samples
    gpu.sleep("actor", parking)
    gpu.wake("critic", parking)
    hooks, steps = ((gpu.hooks["critic"], plan.critic_steps) if every_step
                    else _first_and_last(gpu.hooks["critic"], plan.critic_steps))
    with stage("critic-train"):
        _, kept = train_steps(gpu.critic, hooks, HookContext(plan, config.dmd2, 0, {}, real), pairs, steps)
    gpu.critic.optimizer.zero_grad(set_to_none=True)  # as `RankWorker.score`: the last step's gradients go first
    gpu.wake("teacher", parking)
    with stage("score"):
        scores = score(rank_velocity(family, gpu.teacher, config, device), kept, pairs,
                       HookContext(plan, config.dmd2, 0, {}, real),
                       tapped(rank_velocity(family, gpu.module("critic"), config, device), gpu.module("critic")))
    del kept
    gpu.sleep("teacher", parking)
    gpu.sleep("critic", parking)
    gpu.wake("actor", parking)
    with stage("actor-train"):
        train_steps(gpu.actor, gpu.hooks["actor"], HookContext(plan, config.dmd2, 0, {"critic": scores}, real),
                    pairs, 1)


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
                rehearse(gpu, stages.stage, LedgerParking(ledger))
    critic_steps = config.dmd2.critic_steps_per_rollout
    stages.flops["critic-train"] = stages.flops["critic-train"] * critic_steps // len(rehearsed_steps(critic_steps))
    parameters = sum(p.numel() for p in gpu.teacher.parameters())
    peaks = ledger.peaks
    if config.train.parallel in SHARDED:
        gathers = {role: gathered_ahead(gpu.module(role), torch.bfloat16 if config.train.mixed_precision == "bf16"
                                        else None) for role in ("actor", "critic")} | {"teacher": 0}  # whole
        peaks = [_with_temporaries(peak, max((gathers[name] for name in COMPUTING[peak.stage]), default=0))
                 for peak in peaks]
    # With nothing asleep (sleep = "never"), DDP's wrapper stays too: the asleep group's buckets are resident.
    buckets = {role: DdpBuckets.bytes_of(gpu.module(role)) if replicated(config) else 0 for role in ("actor", "critic")}
    resident = max(peak.peak + stages.parked[peak.stage] + buckets[ASLEEP[peak.stage]] for peak in peaks)
    return MemoryPlan(config.train.world_size, tuple(peaks), max(stages.parked.values()), parameters, resident,
                      stages.flops)


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


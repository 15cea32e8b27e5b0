"""One rollout as a GPU's two ranks run it (rank i of the actor group and of the critic group, on placement bundle i),
on any tensors: fake ones for `dmd2 plan` (infra/trainers/memory_plan.py), real ones for its accuracy test and the GPU
bench (bench/gpu.py). The models are held as the ranks hold them, the stages run the product's code, and a group
sleeps and wakes as the ranks' do (`Parking` says where what sleeps goes). After the rollout, what the run does now
and then on the same GPU: an evaluation (the teacher's reference samples, the student's) and a checkpoint
(`rehearse_outputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dmd2.config_rules import SHARDED
from dmd2.convert import samples_to_train_pairs
from dmd2.draws import RolloutDraws
from dmd2.family import RunSpec
from dmd2.gan import tapped
from dmd2.hooks import score
from dmd2.plan import rollout_plan
from dmd2.precision import teacher_dtype
from dmd2.rollout import rollout_shard
from dmd2.sample import generate
from dmd2.tensors import on_host
from dmd2.trainer import HookContext, Hooks, TrainState, train_state, train_steps
from infra.trainers.configs import compute_trainer_configs
from infra.trainers.ddp_buckets import DdpBuckets
from infra.trainers.hooks import resolve_hooks
from infra.trainers.models import held_model, held_teacher, rank_velocity, role_model
from infra.trainers.offload import module_tensors, sleeping_tensors
from infra.trainers.parallel import borrows_teacher
from infra.trainers.sequence import sequence_mesh

STAGES = ("rollout", "convert", "critic-train", "score", "actor-train")
OUTPUT_STAGES = ("evaluate", "reference", "checkpoint")  # now and then after a rollout (`rehearse_outputs`)
DEVICE = torch.device("cpu")  # fake storage on the CPU stands in for the GPU (fake CUDA fails inside FSDP2)
Load = Callable[[str, "torch.dtype | None"], nn.Module]  # (model path, dtype) -> the model on DEVICE
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
    whole_student: Callable[[], nn.Module] | None = None  # a plain copy of the student, as FSDP2's is gathered
    whole_teacher: Callable[[], nn.Module] | None = None  # a copy of the teacher, as an evaluation loads one

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
    trainers = {trainer.role: trainer for trainer in compute_trainer_configs(config, "checkpoints")}
    for trainer in trainers.values():
        model = held_model(role_model(load(trainer.init, None), family, trainer, config), config, mesh, sequence)
        state = train_state(model, trainer.lr, config, family.velocity, trainer.ema_decay, trainer.steps_per_rollout)
        states[trainer.role] = _with_optimizer_state(state)
        hooks[trainer.role] = resolve_hooks(trainer.hooks, trainer.role)
        if trainer.teacher is not None:
            teacher = held_teacher(load(trainer.teacher, teacher_dtype(config)), config, mesh, sequence)
    actor = trainers["actor"]
    gpu = GpuModels(spec, states["actor"], states["critic"], teacher, hooks, wrap, device,
                    whole_student=lambda: role_model(load(actor.init, None), family, actor, config),
                    whole_teacher=lambda: load(config.model.teacher, teacher_dtype(config)).eval())
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


def rehearse_outputs(gpu: GpuModels, stage: Callable[[str], AbstractContextManager], parking: Parking) -> None:
    """After `rehearse` (the actor awake, the critic asleep), each of `OUTPUT_STAGES` inside ``stage(name)``; as
    there, groups sleep and wake between stages, never inside one. The evaluation's two halves, as
    `StudentOutputs.evaluate` holds the GPU, one batch (`evaluation_batch`) and one step of each sampler (every other
    holds what the first does); decoding and the judges (rank 0, small models) are not rehearsed:

    "evaluate": the student's samples, at every evaluation: this rank's share with the actor as held, or all of
    them on rank 0 with a whole copy of the student (under FSDP2 gathered beside the shards).
    "reference": the teacher's reference samples, made at the run's first evaluation (before the student's: the
    order changes neither's peak), by a family that splits its evaluation: this rank's share, with the critic's
    teacher, which the evaluation borrows in the ranks' process (or, where it cannot, a whole copy it loads while
    the critic's sleeps: see `StudentOutputs._teacher_lender`). Any other family makes them on the host: no row.
    "checkpoint", as `save_groups`: the critic saves first, woken beside the awake actor (DCP copies each tensor to
    host memory as it writes it), and sleeps again."""
    spec, device = gpu.spec, gpu.device
    config, family = spec.config, spec.family
    def sample(teacher: bool) -> dict:
        rows = family.evaluation_batch(config, teacher)
        with on_host():
            cond, neg = spec.conds(RolloutDraws(config.train.seed, 0, rows), torch.arange(rows))
        return dict(cond=cond, neg_cond=neg, sample_shape=spec.sample_shape, num_steps=1, clamp=False)

    with stage("evaluate"), torch.no_grad():
        as_held = family.splits_evaluation or config.train.parallel not in SHARDED
        student = gpu.module("actor") if as_held else gpu.whole_student()
        generate(rank_velocity(family, student, config, device), sampler="student", **sample(False))
        del student
    if family.splits_evaluation:
        borrowed = borrows_teacher(config)
        if borrowed:
            gpu.wake("teacher", parking)
        with stage("reference"), torch.no_grad():
            teacher = gpu.teacher if borrowed else gpu.whole_teacher()
            generate(rank_velocity(family, teacher, config, device), sampler="teacher",
                     guidance_scale=config.dmd2.teacher_guidance_scale, **sample(True))
            del teacher
        gpu.sleep("teacher", parking)
    gpu.wake("critic", parking)
    with stage("checkpoint"):
        pass  # nothing more on the device than both groups' state
    gpu.sleep("critic", parking)

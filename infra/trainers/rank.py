"""One rank of a trainer group: a rank worker holding its share of a data-parallel model.

`RankWorker` is plain Python; `infra.trainers.group.TrainerGroup` keeps one per rank in a Ray actor (a `RankProcess`,
shared by rank i of every group placed together) and joins them with torch.distributed (gloo on CPU, nccl on
CUDA). The model is a DDP replica or FSDP2 shards (`infra.trainers.parallel`). A stage moves its inputs onto the
rank's device once and makes every tensor there (noise, latents, losses); only its output goes back to the host,
into the store. Its evaluation and export of the student are `infra.trainers.student_outputs`.

Every public method takes and returns `ArtifactRef`s (or small dicts of numbers): payloads are
read from and written to the artifact store here, on the rank, never by the driver.
"""

import faulthandler
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmd2.config_rules import SHARDED
from dmd2.convert import samples_to_train_pairs
from dmd2.failures import NonFiniteError
from dmd2.family import RunSpec
from dmd2.gan import tapped
from dmd2.hooks import score
from dmd2.model import VelocityFn
from dmd2.plan import RolloutPlan, rollout_plan
from dmd2.precision import teacher_dtype
from dmd2.rollout import rollout_shard
from dmd2.trainer import HookContext, train_state, train_steps
from infra.trainers.collective import gather_rows, on_every_rank, on_rank0
from infra.trainers.hooks import resolve_hooks
from infra.trainers.models import held_model, held_teacher, rank_velocity, role_model, sharded_from_rank0
from infra.trainers.offload import HostCopy, module_tensors, own_storage, sleeping_tensors
from infra.trainers.parallel import ddp, free_port, rank_device, replicated, use_device
from infra.trainers.sequence import data_rank, sequence_mesh
from infra.trainers.payloads import get_record, put_record
from infra.trainers.prepare import load_prepared
from infra.store import ArtifactRef, ArtifactStore
from infra.trainers.checkpoint import checkpoint_key, load_checkpoint, rng_state, save_checkpoint
from infra.trainers.sharded import state_digest
from infra.trainers.student_outputs import StudentOutputs
from infra.trainers.configs import TrainerConfig
from infra.tracking.system import SystemMetrics, stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """One rank's result of `train`: its output's ref (None without a train_output) and step metrics."""

    output: ArtifactRef | None
    metrics: tuple[dict[str, float], ...] = field(default_factory=tuple)


class RankWorker(StudentOutputs):
    """Rank ``rank`` of the group of ``trainer.role``; call `setup` on every rank before anything else."""

    def __init__(self, trainer: TrainerConfig, spec: RunSpec, store: ArtifactStore, rank: int,
                 world_size: int, num_threads: int = 1, promised_gpus: float = 0.0,
                 system_metrics: SystemMetrics | None = None):
        # A crash in native code (a collective, a kernel) prints every thread's Python stack to the rank's log:
        # Ray's handler prints only the crashing thread's, often a native one (a gloo worker) with none.
        faulthandler.enable(all_threads=True)
        # Several ranks share the node's cores: one thread each unless configured otherwise.
        torch.set_num_threads(num_threads)
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
        self.trainer, self.spec, self.store = trainer, spec, store
        self.rank, self.world_size = rank, world_size
        self.hooks = resolve_hooks(trainer.hooks, trainer.role)
        self.device = rank_device(trainer.role, rank, promised_gpus)
        self.rollouts_trained = 0
        self.optimizer_steps = 0
        self._evaluator, self._references_key, self._references_kept = None, "", False
        self.colocated: dict[str, RankWorker] = {}  # by role, the workers of this process (`RankProcess` sets it)
        self._sleeping, self._teacher_host = HostCopy(), HostCopy()
        self.sharded = spec.config.train.parallel in SHARDED
        # `[train] sleep`: "never" keeps everything resident; "auto" reaches a rank already decided by the distill
        # flow (flows/plan.py `resolve_sleep`), and undecided (groups built without the flow) it sleeps.
        self.sleeps = spec.config.train.sleep != "never"
        self._system_metrics = system_metrics.start() if system_metrics else None

    # -- setup ----------------------------------------------------------------------------------

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0 only)."""
        import ray  # only the rendezvous needs Ray; the rest of the rank is plain torch

        return ray.util.get_node_ip_address(), free_port()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def device_uuid(self) -> str | None:
        """The UUID of this rank's GPU (None on a CPU), which tells two ranks' GPUs apart across processes."""
        if self.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the group's process group and load the models (the teacher parked on the host). Rank i of a
        group sharing this process (`infra.trainers.group.RankProcess`) has joined it already: the groups share
        their world size, so one process group serves them all (their stages never overlap)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        use_device(self.device)
        if not dist.is_initialized():
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(minutes=10))
        elif (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise RuntimeError(f"{self.trainer.role} rank {self.rank} of {self.world_size} cannot share a process with "
                               f"rank {dist.get_rank()} of {dist.get_world_size()}")
        # Checkpoint metadata travels between ranks as Python objects: on a CPU group, whatever the backend.
        self._objects = dist.new_group(backend="gloo") if backend == "nccl" else None
        # `[train] sequence_parallel`: the ranks each sample's tokens are split over (None: off).
        self.sequence = sequence_mesh(self.spec.config.train, self.device.type)
        # The family holding its prepared inputs (e.g. the prompt table): every model call goes through it.
        prepared = load_prepared(self.store, self.spec.prepared, self.spec.cache_dir)
        self.family = family = self.spec.family.bind(prepared, self.device)
        self.real = family.real_source(self.spec)  # the GAN's real samples: the driver's, or the prepared ones
        config = self.spec.config
        init, trainer = self.trainer.init, self.trainer
        if self.sharded:  # no rank holds the whole model on its device; only rank 0 on its host
            self._module = sharded_from_rank0(lambda: role_model(family.load_model(init), family, trainer, config),
                                              lambda: role_model(family.model_on_meta(init), family, trainer, config),
                                              config, self.device)
        else:
            model = own_storage(role_model(family.load_model(init), family, trainer, config).to(self.device))
            self._module = held_model(model, config, sequence=self.sequence)
        # The optimizer is built over the sharded parameters under FSDP; DDP's wrapper comes with `wake`.
        self.state = train_state(self._module, self.trainer.lr, config, family.velocity,
                                 self.trainer.ema_decay, self.trainer.steps_per_rollout)
        self._recipe_lrs = list(self.state.scheduler.base_lrs)  # what `retune` scales
        if self.world_size > 1:  # every rank's loss and grad norm: a non-finite step stops all ranks alike
            self.state.gather = gather_rows(self._objects)
        self._wrap()
        self.teacher = None
        if self.trainer.teacher is not None:
            self.teacher = self._held_teacher(self.trainer.teacher, teacher_dtype(config))
            if self.sleeps:
                self._teacher_host.offload(module_tensors(self.teacher))  # on the device only while scoring
        self.sleep()  # asleep until its first stage: at no time are two groups awake for nothing
        logger.info("ready: %s from %s on %s (%s)", self.trainer.role, self.trainer.init, self.device, backend)

    def _held_teacher(self, path: str, dtype: torch.dtype) -> nn.Module:
        """The frozen teacher as `held_teacher` holds it: sharded like the critic (read by rank 0 alone), or whole."""
        family, config = self.family, self.spec.config
        if self.sharded:
            return sharded_from_rank0(lambda: family.load_model(path, dtype), lambda: family.model_on_meta(path, dtype),
                                      config, self.device, hold=held_teacher)
        return held_teacher(own_storage(family.load_model(path, dtype).to(self.device)), config,
                            sequence=self.sequence)

    def _velocity(self, model: nn.Module) -> VelocityFn:
        return rank_velocity(self.family, model, self.spec.config, self.device)

    def _wrap(self) -> None:
        """The trained model as the optimizer steps see it: DDP's wrapper (built anew, see `infra.trainers.parallel`)
        at world size > 1, else the module itself (sharded, or alone: nothing to average)."""
        self.state.model = ddp(self._module, self.device) if replicated(self.spec.config) else self._module
        self.state.velocity = tapped(self._velocity(self.state.model), self.module)  # the GAN's logits, if a head

    @property
    def module(self) -> nn.Module:
        """The unwrapped model (a diffusers model; its parameters sharded under FSDP)."""
        return self._module

    def plan(self, rollout_id: int) -> RolloutPlan:
        return rollout_plan(self.spec.config, rollout_id, self.spec.sample_shape)

    def _ctx(self, rollout_id: int, external_data: dict[str, Any] | None = None) -> HookContext:
        return HookContext(self.plan(rollout_id), self.spec.config.dmd2, self.rank, external_data or {}, self.real)

    # -- the rollout's stages ------------------------------------------------------------------

    def rollout(self, run_id: str, rollout_id: int) -> ArtifactRef:
        """This rank's backward-simulated samples -> ``rollout-<n>/rollout/rank-<r>``."""
        self.wake()
        samples = rollout_shard(self._velocity(self.module), self.spec.conds, self.plan(rollout_id),
                                data_rank(self.rank, self.spec.config.train), self.device, lockstep=self.sharded)
        return put_record(self.store, run_id, rollout_id, "rollout", self.rank, samples)

    def convert(self, run_id: str, rollout_id: int, samples: ArtifactRef) -> ArtifactRef:
        """One train pair per sample -> ``rollout-<n>/convert/rank-<r>``."""
        pairs = samples_to_train_pairs(get_record(self.store, samples), self.spec.config.student.num_steps)
        return put_record(self.store, run_id, rollout_id, "convert", self.rank, pairs)

    def train(self, run_id: str, rollout_id: int, pairs: ArtifactRef,
              external_data: dict[str, ArtifactRef] | None = None) -> TrainResult:
        """``steps_per_rollout`` optimizer steps; the train_output goes to ``rollout-<n>/<role>-train``.

        ``external_data`` maps an earlier group's role to the ref of its paired rank's output; the hooks
        see the loaded records as ``ctx.external_data[<role>]``.
        """
        self.wake()

        def read_inputs():  # a rank whose inputs are unreadable must not leave the others in backward's all-reduce
            return ({role: get_record(self.store, ref, self.device) for role, ref in (external_data or {}).items()},
                    get_record(self.store, pairs, self.device))

        loaded, own_pairs = on_every_rank(read_inputs, self._objects)
        try:
            metrics, output = train_steps(self.state, self.hooks, self._ctx(rollout_id, loaded), own_pairs,
                                          self.trainer.steps_per_rollout)
        except NonFiniteError as error:
            raise NonFiniteError(f"rollout {rollout_id}, {self.trainer.role} group, {error}: the step was not "
                                 "applied and nothing of it was stored; the run's last checkpoint (if any) stays its "
                                 "latest. Lower [optim] lr / critic_lr, or raise [optim] warmup_steps") from None
        self.rollouts_trained += 1
        self.optimizer_steps += len(metrics)
        ref = None
        if output is not None:
            ref = put_record(self.store, run_id, rollout_id, f"{self.trainer.role}-train", self.rank, output)
        return TrainResult(ref, tuple(metrics))

    def score(self, run_id: str, rollout_id: int, kept: ArtifactRef, pairs: ArtifactRef) -> ArtifactRef:
        """The teacher's x0_real at the kept x_s -> ``rollout-<n>/score/rank-<r>`` (Scores)."""
        if self.teacher is None:
            raise RuntimeError(f"the {self.trainer.role} group holds no teacher; score on the critic group")
        self.wake()  # the critic, without its last step's gradients (`train_steps` drops them)
        if self._teacher_host.parked:
            self._teacher_host.restore()
        try:
            scores = score(self._velocity(self.teacher), get_record(self.store, kept, self.device),  # the critic
                           get_record(self.store, pairs, self.device), self._ctx(rollout_id),  # unwrapped: no DDP
                           tapped(self._velocity(self.module), self.module))
        finally:
            if self.sleeps:
                self._teacher_host.offload(module_tensors(self.teacher))  # offloaded after scoring (architecture §1.4)
        return put_record(self.store, run_id, rollout_id, "score", self.rank, scores)

    # -- sleep / wake --------------------------------------------------------------------------

    @contextmanager
    def _in_use(self):
        """Awake for the body; back asleep after it if it was asleep (checkpoints, evaluation, export
        must not leave a sleeping group on the accelerator)."""
        was_asleep = self._sleeping.parked
        self.wake()
        try:
            yield
        finally:
            if was_asleep:
                self.sleep()

    @contextmanager
    def lend_teacher(self):
        """The frozen teacher on this rank's device for the block (brought back from host memory if parked, and
        parked again after), for the evaluation's reference samples on the same GPU: no second copy beside it."""
        if self.teacher is None:
            raise RuntimeError(f"the {self.trainer.role} group holds no teacher to lend")
        parked = self._teacher_host.parked
        if parked:
            self._teacher_host.restore()
        try:
            yield self.teacher
        finally:
            if parked:
                self._teacher_host.offload(module_tensors(self.teacher))

    def awake(self) -> bool:
        """Whether this rank's weights are on its accelerator now (the sleep ledger reads it)."""
        return not self._sleeping.parked

    def sleep(self) -> dict[str, int]:
        """Weights and optimizer state leave the accelerator (the teacher already has); idempotent. With `[train]
        sleep = "never"` only the gradients go: nothing is copied."""
        if self._sleeping.parked:
            return {"offloaded_bytes": 0}
        if not self.sleeps:
            self.state.optimizer.zero_grad(set_to_none=True)  # the next step recomputes them: nothing to keep
            return {"offloaded_bytes": 0}
        parked = sleeping_tensors(self.module, self.state)  # drops the gradients
        self.state.model = self.state.velocity = None  # DDP's wrapper goes, and its gradient buckets with it
        return {"offloaded_bytes": self._sleeping.offload(parked)}

    def wake(self) -> None:
        """Bring back what `sleep` moved, bit for bit; a no-op when awake. Every stage wakes on use."""
        if self._sleeping.parked:
            self._sleeping.restore()
            self._wrap()

    def retune(self, seed: int, lr_factor: float) -> None:
        """Draw the rollouts from `seed` and train at `lr_factor` x the recipe's learning rates, on the schedule's
        current step: the collapse guard's recovery after loading a checkpoint (`flows/collapse.py`). Absolute,
        not relative: a checkpoint saved after a rollback already holds scaled rates, and retuning it is a no-op."""
        self.spec = replace(self.spec, config=self.spec.config.replace("train", seed=seed))
        scheduler = self.state.scheduler
        scheduler.base_lrs = [lr * lr_factor for lr in self._recipe_lrs]
        for group, base, factor in zip(self.state.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)

    def device_memory(self) -> int:
        """Bytes the rank's tensors occupy on its accelerator now (0 on CPU)."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def peak_device_memory(self, reset: bool = False) -> int:
        """The most bytes the rank's tensors occupied on its accelerator since the last reset (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        peak = torch.cuda.max_memory_allocated(self.device)
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    # -- checkpoints and inspection ------------------------------------------------------------

    def save(self, run_id: str, step: int, linked: dict[str, ArtifactRef] | None = None) -> ArtifactRef:
        """All ranks call; rank 0 stores ``<run_id>/<checkpoint_dir>/<step>`` (atomic). Returns its ref.

        ``linked`` (e.g. the critic checkpoint of the same step) is recorded in ``checkpoint.json``, so
        one visible checkpoint finds the rest.
        """
        with self._in_use():
            rng_states: list[Any] = [None] * self.world_size
            dist.all_gather_object(rng_states, rng_state(), group=self._objects)
            info = {"role": self.trainer.role, "step": step, "world_size": self.world_size,
                    "parallel": self.spec.config.train.parallel,
                    "rollouts_trained": self.rollouts_trained, "optimizer_steps": self.optimizer_steps,
                    "linked": {role: r.to_dict() for role, r in (linked or {}).items()}}
            key = checkpoint_key(run_id, self.trainer.checkpoint_dir, step)
            ref = save_checkpoint(self.store, key, self.module, self.state.optimizer, self.state.scheduler,
                                  rng_states, info, self._objects, self.state.ema)
            return on_rank0(lambda: ref, self._objects)  # rank 0's ref, on every rank

    def load(self, checkpoint: ArtifactRef) -> dict[str, ArtifactRef]:
        """Load a checkpoint of this role in place (every rank, at any world size and either layout);
        returns its linked checkpoints' refs."""
        with self._in_use():
            info = load_checkpoint(self.store, checkpoint, self.trainer.role, self.module, self.state.optimizer,
                                   self.state.scheduler, self.rank, self.state.ema)
            if info["world_size"] != self.world_size:
                logger.warning("checkpoint from world size %d loaded at %d: RNG states of new ranks are fresh",
                               info["world_size"], self.world_size)
            self.rollouts_trained, self.optimizer_steps = info["rollouts_trained"], info["optimizer_steps"]
            return {role: ArtifactRef.from_dict(r) for role, r in info["linked"].items()}

    def state_digest(self) -> str:
        """`infra.trainers.sharded.state_digest` of the group's model, optimizer and EMA. Collective."""
        with self._in_use():
            return state_digest(self.module, self.state.optimizer, self.state.ema and self.state.ema.state_dict())

    def shutdown(self, leave_process_group: bool = True) -> None:
        """Flush the system metrics; leave the process group unless a group sharing the process still uses it."""
        if self._system_metrics is not None:
            stop(self._system_metrics)
        if leave_process_group and dist.is_initialized():
            dist.destroy_process_group()

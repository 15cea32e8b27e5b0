"""A rank's place in its group: its device, the rendezvous port, and how its model spreads over the
group, DDP (a full replica per rank) or FSDP2 (sharded per block).

`[train] parallel = "ddp"`: each rank holds the whole model; `ddp` wraps it so backward averages the
gradients. The wrapper owns DDP's gradient buckets (a model's worth of memory on the accelerator), so
a sleeping rank drops it and a waking one builds a new one (`init_sync=False`: the replicas are
already equal, nothing is broadcast).

`[train] parallel = "fsdp"`: `torch.distributed.fsdp.fully_shard` on every block (`shard_units`) and on
the root, so each rank holds 1/W of the parameters, gradients and AdamW state and all-gathers one
block at a time. Every forward of a sharded model is a collective: ranks must make the same number
(the rollout runs in lockstep, `dmd2.rollout.backward_simulate`), and evaluation and export work on
one gathered copy (`full_state_dict`, `unsharded_copy`).

`[train] parallel = "hsdp"`: the same FSDP2 over a 2-D mesh (`shard_mesh`): each group of
`shard_group_size` consecutive ranks (a node's) shards one copy, and the copies are replicas, their
gradients all-reduced across the groups after each group's reduce-scatter: gathers stay inside a node.
"""

import functools
import inspect
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dmd2.config import DistillConfig, TrainConfig
from dmd2.config_rules import SHARDED
from dmd2.lora import add_adapters_like, has_adapters


def no_buffer_sync(wrapper: type) -> dict[str, bool]:
    """DDP's argument for no buffer sync in forward (a collective in every forward; buffers are equal from the
    start): torch 2.13 names it `forward_sync_buffers`, earlier ones (the GPU image's 2.11) `broadcast_buffers`."""
    new_name = "forward_sync_buffers" in inspect.signature(wrapper).parameters
    return {"forward_sync_buffers": False} if new_name else {"broadcast_buffers": False}


NO_BUFFER_SYNC = no_buffer_sync(nn.parallel.DistributedDataParallel)


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it), for torch.distributed's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def rank_device(role: str, rank: int, promised_gpus: float) -> torch.device:
    """The rank's device: the GPU Ray gave it (Ray sets CUDA_VISIBLE_DEVICES, so it is cuda:0), or the CPU.

    A rank promised a GPU that sees none fails here, at once, rather than training on the CPU unnoticed.
    """
    if promised_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{role} rank {rank} was given {promised_gpus:g} GPU by Ray but torch sees none (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, torch {torch.__version__} "
            f"{'with' if torch.backends.cuda.is_built() else 'without'} CUDA): install a CUDA build of torch on "
            "every node, or set [cluster] gpus_per_rank = 0 to train on CPUs")
    return torch.device("cuda", 0)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's GPU, its fp32 matmuls in TF32 (the fp32 parts of a bf16 run, and an fp32 run:
    tensor cores, at a 10-bit mantissa, as large trainers run); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")


def ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """The DDP wrapper of ``model``: gradients averaged over ranks in backward.

    Forwards without grad (rollout, scoring) run on the unwrapped module, so ranks may make different
    numbers of them without a collective falling out of step.
    """
    ids = [device.index or 0] if device.type == "cuda" else None
    # Gradients as views into the buckets: one model's worth of gradient memory instead of two.
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, init_sync=False, gradient_as_bucket_view=True,
                                               **NO_BUFFER_SYNC)



def replicated(config: DistillConfig) -> bool:
    """Whether each rank holds a whole model whose gradients are averaged over ranks (DDP's wrapper, `ddp`)."""
    return config.train.parallel not in SHARDED and config.train.world_size > 1


def borrows_teacher(config: DistillConfig) -> bool:
    """Whether a split evaluation's reference samples borrow the critic's teacher in the ranks' process
    (`StudentOutputs`), sharded and split over a sequence group as the critic holds it, rather than each rank load a
    whole copy: not when the groups run in processes of their own (`[cluster] colocate = false`). The ranks and the
    plan read it alike."""
    return config.cluster.colocate


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: those of the classes the model lists in `_no_split_modules`
    (diffusers names its transformer blocks there: SD3's `JointTransformerBlock`), else the entries of
    its top-level ModuleLists (a UNet's down and up blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [module for module in model.modules() if type(module).__name__ in names]
    return [unit for child in model.children() if isinstance(child, nn.ModuleList) for unit in child]


def compile_blocks(model: nn.Module) -> None:
    """Compile each of `shard_units` in place (`nn.Module.compile`), as torchtitan does: a block's graph is small,
    the same for every block, and is compiled once; under FSDP2 its gathers stay outside the graphs (the blocks are
    sharded after). Not with activation checkpointing (refused by `dmd2.config_rules`: the recomputation meets a
    recompiled graph). A model on fake tensors (`dmd2 plan`'s) stays eager: nothing can be compiled for values that
    do not exist."""
    if any(is_fake(param) for param in model.parameters()):
        return
    for block in shard_units(model):
        block.compile(options=COMPILE_OPTIONS)


# Inductor's layout optimization (convolutions in channels-last) gives diffusers' UpBlock2D zero gradients for
# everything before its upsampler on torch 2.13's CPU (found by tests/dmd2/test_compile.py); transformer
# blocks hold no convolutions, so it costs them nothing.
COMPILE_OPTIONS = {"layout_optimization": False}


def mesh_shape(train: TrainConfig) -> tuple[int, ...]:
    """The ranks FSDP2 spreads a model over: (world_size,) shards; under `hsdp`, (replicas, shard_group_size)."""
    if train.parallel == "hsdp":
        return train.world_size // train.shard_group_size, train.shard_group_size
    return (train.world_size,)


@functools.cache  # once per process group: both roles' ranks share it (a mesh's groups are made collectively)
def _device_mesh(device_type: str, shape: tuple[int, ...], world: object) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def shard_mesh(train: TrainConfig, device_type: str) -> DeviceMesh | None:
    """The mesh of `mesh_shape` for a rank's sharded model: None under `fsdp` (FSDP2's default, the whole
    process group), a 2-D mesh under `hsdp` (FSDP2 shards over its second dimension, replicates over the first)."""
    if train.parallel != "hsdp":
        return None
    return _device_mesh(device_type, mesh_shape(train), dist.group.WORLD)  # a new process group: a new mesh


def fsdp(model: nn.Module, bf16: bool, mesh: DeviceMesh | None = None) -> nn.Module:
    """``model`` sharded in place per `shard_units` and at the root; its parameters become DTensors.

    ``mesh``: the ranks to shard over, default the whole process group (a memory measurement on fake tensors
    passes one made before its fake mode: a mesh cannot be made inside it).

    Under bf16 the gathered weights are bf16 and gradients are reduced in fp32 onto fp32 shards (the
    master weights). Inputs are not cast (`cast_forward_inputs=False`): the timestep must reach the
    model in fp32 (`dmd2.precision`), and autocast casts what the matmuls see.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    # The root reshards after forward too: a sleeping rank must hold no gathered weights.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's host (empty on other ranks). Collective under FSDP."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain (unsharded) model of ``model``'s diffusers class and config holding ``state``."""
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclassed it
    copy = cls.from_config(model.config)
    if has_adapters(model):  # LoRA (dmd2/lora.py): the state holds the adapters' tensors too
        copy = add_adapters_like(copy, model)
    copy.load_state_dict(state, strict=True)
    return copy

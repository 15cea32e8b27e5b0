"""How a rank holds its models: the trained model from its loaded init (`role_model`), on its device as
`[train]` says (`held_model`), the frozen teacher likewise (`held_teacher`), and the call the algorithm makes
(`rank_velocity`).
The rank workers (infra/trainers/rank.py) and `dmd2 plan` (infra/trainers/memory_plan.py) share them, so the
plan measures the very models a run trains."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from dmd2.config import DistillConfig
from dmd2.config_rules import SHARDED
from dmd2.family import ModelFamily
from dmd2.gan import attach_gan_head
from dmd2.lora import with_role_adapters
from dmd2.model import VelocityFn
from dmd2.precision import in_run_precision
from infra.trainers.configs import TrainerConfig
from infra.trainers.parallel import compile_blocks, fsdp, shard_mesh
from infra.trainers.sequence import sequence_mesh, split_sequence


def role_model(model: nn.Module, family: ModelFamily, trainer: TrainerConfig, config: DistillConfig) -> nn.Module:
    """The model a group trains, from its loaded init: the family's part of it for the role (`trained_part`), LoRA
    adapters over it with `[student] lora_rank`, and the critic's GAN head with `[dmd2] critic_gan_weight` (a
    submodule: it trains, sleeps and is checkpointed with the critic, dmd2/gan.py). Shared with `dmd2 plan`
    (infra/trainers/memory_plan.py), which gives it fake storage."""
    model = with_role_adapters(family.trained_part(model, trainer.role, config), config, trainer.role,
                               family.lora_targets)
    if trainer.gan_head:
        model = attach_gan_head(model, family.gan_tap(model), config.train.seed)
    return model


def held_model(model: nn.Module, config: DistillConfig, mesh: DeviceMesh | None = None,
               sequence: DeviceMesh | None = None) -> nn.Module:
    """The trained model on its device as `[train]` holds it: its tokens split over ``sequence``'s ranks (`[train]
    sequence_parallel`, infra/trainers/sequence.py), activations recomputed in backward (diffusers' own gradient
    checkpointing), each block compiled (`compile`) and, with `parallel = "fsdp"` or `"hsdp"`, sharded over
    ``mesh`` (default: the process group)."""
    train = config.train
    split_sequence(model, sequence)
    if train.activation_checkpointing:
        model.enable_gradient_checkpointing()
    if train.compile:
        compile_blocks(model)
    return fsdp(model, train.mixed_precision == "bf16", mesh) if train.parallel in SHARDED else model


def held_teacher(model: nn.Module, config: DistillConfig, mesh: DeviceMesh | None = None,
                 sequence: DeviceMesh | None = None) -> nn.Module:
    """The frozen teacher on its device as the critic is held, never trained: its tokens split over ``sequence``'s
    ranks and, with `parallel = "fsdp"` or `"hsdp"`, sharded over ``mesh`` (each forward gathers one block at a time,
    as the critic's do: an eighth of it on each of 8 GPUs, where each held a whole copy)."""
    split_sequence(model, sequence)
    if config.train.parallel in SHARDED:
        model = fsdp(model, config.train.mixed_precision == "bf16", mesh)
    return model.eval().requires_grad_(False)


def sharded_from_rank0(load: Callable[[], nn.Module], on_meta: Callable[[], nn.Module], config: DistillConfig,
                       device: torch.device, hold: Callable[..., nn.Module] = held_model) -> nn.Module:
    """A model held by ``hold`` (`held_model`, or `held_teacher`), sharded over `shard_mesh` without a whole copy on
    any device, and on the host of rank 0 alone: every rank builds it on the meta device (``on_meta``) and shards it
    there, rank 0 reads the weights into host memory (``load``), and each rank receives its shards of them
    (`set_model_state_dict` with `broadcast_from_rank0`, one tensor at a time through the device). Buffers,
    which FSDP2 leaves whole, are rank 0's, broadcast. Collective: every rank of the group calls it."""
    whole = load() if dist.get_rank() == 0 else None
    model = hold(on_meta(), config, shard_mesh(config.train, device.type),
                 sequence_mesh(config.train, device.type)).to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole.state_dict() if whole is not None else {}, options=options)
    buffers = dict(whole.named_buffers()) if whole is not None else {}
    for name, buffer in model.named_buffers():  # non-persistent ones are in no state dict
        if whole is not None:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    return model


def rank_velocity(family: ModelFamily, model: nn.Module, config: DistillConfig, device: torch.device) -> VelocityFn:
    """How a rank calls a model: the family's call, in the run's precision (`in_run_precision`)."""
    return in_run_precision(family.velocity(model), config, device.type)

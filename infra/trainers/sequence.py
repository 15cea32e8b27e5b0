"""Sequence parallelism: `[train] sequence_parallel = N` splits each sample's tokens over N ranks of a group.

Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"), through diffusers' context parallelism: the model's `_cp_plan`
splits the tokens after the patch embedding (and the rotary embedding with them), each attention exchanges the
token split for a head split (an all-to-all before and after it), and the output is gathered whole at `proj_out`.
The N ranks of a sequence group hold the same samples (every stage draws by *data rank*, `data_rank`), so the
group's ranks make the same forwards and compute the same loss on the gathered output.

What diffusers 0.42 lacks for training, written here:
- `enable_parallelism` finds a rank's device as `rank % torch.accelerator.device_count()`, which divides by zero
  on a CPU-only torch (gloo); `split_sequence` sets the same configuration up with the rank's own mesh.
- Gradients: the all-to-alls are autograd functions (`TemplatedUlyssesAttention`: the backward all-to-alls the
  gradients back; the output gather's backward keeps the rank's own tokens' gradient), so each rank's parameter
  gradients are its tokens' part of the whole; a group's gradient is the *sum* of its N parts, where DDP and FSDP2
  average over every rank. The trainer scales the loss it differentiates by N (`TrainState.sequence_ranks`), which
  turns the world's mean into the mean over data ranks of the sums over sequence ranks.

The mesh is (data, ring, ulysses) = (world / N, 1, N): rank r is data rank r // N, sequence rank r % N (a
sequence group is N consecutive ranks: a node's GPUs). FSDP2 shards over the whole group as before: the sequence
ranks' parameters are equal, so they can share the shards.
"""

import functools

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dmd2.config import TrainConfig

MESH_DIMS = ("data", "ring", "ulysses")  # diffusers' ContextParallelConfig reads the "ring" and "ulysses" dims


def data_rank(rank: int, train: TrainConfig) -> int:
    """The rank's place among the data-parallel ranks: the sequence ranks of one group share it (their samples)."""
    return rank // train.sequence_parallel


def sequence_rank(rank: int, train: TrainConfig) -> int:
    """The rank's place in its sequence group: which part of each sample's tokens it holds."""
    return rank % train.sequence_parallel


@functools.cache  # once per process group: both roles' ranks share it (a mesh's groups are made collectively)
def _mesh(device_type: str, shape: tuple[int, ...], world: object) -> DeviceMesh:
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["ring", "ulysses"]._flatten()  # diffusers' setup flattens it: made now, the mesh keeps it (not in a fake mode)
    return mesh


def sequence_mesh(train: TrainConfig, device_type: str) -> DeviceMesh | None:
    """The (data, ring, ulysses) mesh of the process group, or None without sequence parallelism. Collective the
    first time in a process group; `dmd2 plan` makes it before its fake mode (a mesh cannot be made inside one)."""
    if train.sequence_parallel == 1:
        return None
    shape = (train.world_size // train.sequence_parallel, 1, train.sequence_parallel)
    return _mesh(device_type, shape, dist.group.WORLD)  # a new process group: a new mesh


def sequence_models(model: nn.Module) -> list[nn.Module]:
    """The diffusers models in ``model`` that split tokens (a `_cp_plan`): itself, or e.g. Wan 2.2's two experts."""
    return [module for module in model.modules() if getattr(module, "_cp_plan", None)]


def split_sequence(model: nn.Module, mesh: DeviceMesh | None) -> nn.Module:
    """``model`` with each of its `sequence_models` splitting tokens over ``mesh``'s ulysses dimension (diffusers'
    `enable_parallelism`, set up as described in the module docstring); unchanged when ``mesh`` is None."""
    if mesh is None:
        return model
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    parts = sequence_models(model)
    if not parts:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan (`_cp_plan`): its family cannot run "
                         "[train] sequence_parallel > 1; set it to 1")
    for part in parts:
        config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=mesh["ulysses"].size(),
                                                                              mesh=mesh))
        config.setup(dist.get_rank(), dist.get_world_size(), None, mesh=mesh)
        for module in part.modules():  # attention processors that read it (self-attention; cross-attention not)
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config
        part._parallel_config = config
        apply_context_parallel(part, config.context_parallel_config, part._cp_plan)
    return model

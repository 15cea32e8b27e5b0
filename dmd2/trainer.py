"""The generic trainer every group runs (in-process loop and Ray ranks alike): optimizer steps driven by hooks.

What makes a group a DMD2 critic or a DMD2 actor is its hooks (`dmd2.hooks`):

    train_input(ctx, pairs) -> pairs                        reshape a group's pairs before batching
    prepare(ctx, pairs, step) -> batch                      the pairs of optimizer step `step`
    loss(ctx, model, batch, step) -> (loss, metrics, keep)  one step's loss and metrics (one-element tensors, read
                                                            once the step is issued, or numbers); `keep` feeds
                                                            train_output
    train_output(ctx, kept) -> output                       no grad, after the steps; the group's output

`ctx` is rollout-level and read-only (`HookContext`); what changes per step (the step index, what a
loss keeps) travels as arguments and return values, never as mutations of a shared context.
"""

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig, DMD2Config
from dmd2.convert import TrainPairs
from dmd2.ema import ParameterEMA
from dmd2.model import DiffusersVelocity, VelocityFn
from dmd2.failures import NonFiniteError
from dmd2.optim import GatherFigures, make_optimizer, optimizer_step
from dmd2.plan import RolloutPlan
from dmd2.tensors import figure


@dataclass(frozen=True)
class HookContext:
    """Rollout-level, read-only context of a group's hooks on one rank."""

    plan: RolloutPlan
    dmd2: DMD2Config
    rank: int
    external_data: dict[str, Any] = field(default_factory=dict)
    real: Any = None  # the family's real samples (a `dmd2.gan.RealSource`), for the critic's GAN loss; None: none


@dataclass
class TrainState:
    """A trained model with its optimizer and lr schedule; `velocity` is how the algorithm calls it."""

    model: nn.Module
    velocity: VelocityFn
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    gather: GatherFigures | None = None  # a data-parallel group's: every rank's loss and grad norm
    ema: ParameterEMA | None = None  # the student's with `[student] ema_decay`: updated after every step
    sequence_ranks: int = 1  # `[train] sequence_parallel`: the ranks whose gradients are parts of one sum


@dataclass(frozen=True)
class Hooks:
    """A group's four hooks (see the module docstring for their signatures)."""

    loss: Callable[[HookContext, VelocityFn, TrainPairs, int], tuple[Tensor, dict[str, Tensor | float], Any]]
    prepare: Callable[[HookContext, TrainPairs, int], TrainPairs]
    train_input: Callable[[HookContext, TrainPairs], TrainPairs] = lambda ctx, pairs: pairs
    train_output: Callable[[HookContext, list[Any]], Any] = lambda ctx, kept: None


def train_state(model: nn.Module, lr: float, config: DistillConfig,
                velocity: Callable[[nn.Module], VelocityFn] = DiffusersVelocity, ema_decay: float = 0.0,
                steps_per_rollout: int = 1) -> TrainState:
    """A model in train mode with AdamW and the lr schedule of `config.optim` (warmup, decay).

    `velocity` makes the model's velocity call (a family's adapter; default: a diffusers model's);
    `ema_decay` > 0 (the student's `[student] ema_decay`) keeps an EMA of its trainable parameters;
    `steps_per_rollout` (the critic's K) places the decay on the run's last optimizer steps.
    """
    optim = config.optim
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only (dmd2/lora.py)
    total = config.train.rollouts * steps_per_rollout
    optimizer, scheduler = make_optimizer(trained, lr, optim.betas, optim.weight_decay, optim.warmup_steps,
                                          decay_steps=round(optim.decay_fraction * total), total_steps=total)
    ema = ParameterEMA(model, ema_decay) if ema_decay > 0 else None
    return TrainState(model.train(), velocity(model), optimizer, scheduler, optim.grad_clip, ema=ema,
                      sequence_ranks=config.train.sequence_parallel)


def train_steps(
    state: TrainState, hooks: Hooks, ctx: HookContext, pairs: TrainPairs, num_steps: int
) -> tuple[list[dict[str, float]], Any]:
    """`num_steps` optimizer steps (their gradients dropped after the last), then the train-output hook without grad;
    returns (per-step metrics, output).

    A non-finite step stops the steps (`NonFiniteError` naming it); the ones before it stay applied."""
    pairs = hooks.train_input(ctx, pairs)
    metrics, kept = [], []
    for step in range(num_steps):
        loss, step_metrics, keep = hooks.loss(ctx, state.velocity, hooks.prepare(ctx, pairs, step), step)
        try:
            stepped = optimizer_step(state.model, state.optimizer, state.scheduler, loss, state.grad_clip, state.gather,
                                     state.sequence_ranks)
        except NonFiniteError as error:
            raise NonFiniteError(f"optimizer step {step + 1} of {num_steps}: {error}") from None
        if state.ema is not None:
            state.ema.update()
        metrics.append(stepped | {name: figure(value) if isinstance(value, Tensor) else value  # a hook's own: a number
                                  for name, value in step_metrics.items()})
        kept.append(keep)
    # The last step's gradients: nothing reads them again (every step starts from zero_grad), and kept they would
    # stay on the device through every stage until the group trains again (`dmd2 plan` counts what they cost).
    state.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        return metrics, hooks.train_output(ctx, kept)

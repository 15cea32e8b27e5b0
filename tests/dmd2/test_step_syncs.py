"""A training step waits for the host only once its update is issued: nothing between a stage's first forward
and its optimizer step reads a value back (`.item()`, `float()`, `bool()`) or makes a tensor whose size depends
on values (`nonzero`, `masked_select`, a boolean-mask index), any of which stalls a GPU until it drains.

On CPU every tensor is on the host, so the count is of those ops as torch dispatches them (a `TorchDispatchMode`);
on CUDA, torch's own sync debug mode errors on any synchronisation in the same window as well. The window opens at
the trained model's first forward and closes as its optimizer steps, for one critic and one actor step of DMD2 on a
tiny digits UNet.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmd2.conditioning import ClassLabels
from dmd2.config import DistillConfig, DMD2Config, ModelConfig, OptimConfig, StudentConfig, TrainConfig
from dmd2.convert import samples_to_train_pairs
from dmd2.failures import NonFiniteError
from dmd2.families.digits.model import build_digits_unet
from dmd2.hooks import ACTOR_HOOKS, CRITIC_HOOKS, score
from dmd2.loop import InProcessDistiller
from dmd2.optim import make_optimizer, optimizer_step
from dmd2.plan import rollout_plan
from dmd2.rollout import rollout_shard
from dmd2.trainer import HookContext, TrainState, train_steps

aten = torch.ops.aten
READS_A_VALUE = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten.nonzero_static.default}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]


class StepSyncs(TorchDispatchMode):
    """The ops that would wait for a GPU, from the model's first forward to its optimizer's step."""

    def __init__(self, state: TrainState):
        super().__init__()
        self.calls: list[str] = []
        self.open = self.closed = False
        self._hooks = [state.model.register_forward_pre_hook(lambda *_: self._open()),
                       state.optimizer.register_step_pre_hook(lambda *_: self._close())]
        self._cuda = next(state.model.parameters()).is_cuda

    def _open(self):
        if not (self.open or self.closed):
            self.open = True
            if self._cuda:
                torch.cuda.set_sync_debug_mode("error")

    def _close(self):
        self.open, self.closed = False, True
        if self._cuda:
            torch.cuda.set_sync_debug_mode("default")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.open and (func in READS_A_VALUE or func in VALUE_SHAPED or _boolean_index(func, args)):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._close()
        return super().__exit__(*exc)


def _boolean_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(index is not None and index.dtype == torch.bool for index in args[1])


def distiller(device: str) -> InProcessDistiller:
    torch.manual_seed(0)
    teacher = build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).to(device)
    config = DistillConfig(model=ModelConfig(teacher="tiny"), student=StudentConfig(num_steps=2),
                           optim=OptimConfig(lr=1e-4, critic_lr=1e-4),
                           dmd2=DMD2Config(teacher_guidance_scale=2.0, critic_steps_per_rollout=1),
                           train=TrainConfig(rollouts=1, rollout_batch_size=8, seed=1))
    return InProcessDistiller.from_models(config, teacher, ClassLabels(10, 10), (1, 8, 8))


def fused(state: TrainState) -> TrainState:
    state.optimizer, state.scheduler = make_optimizer(state.model.parameters(), 1e-4, (0.0, 0.999), 0.01, 0,
                                                      fused=True)
    return state


def one_critic_and_one_actor_step(run: InProcessDistiller) -> tuple[StepSyncs, StepSyncs]:
    """`dmd2.loop.run_rollout`'s stages, each group's steps watched."""
    plan = rollout_plan(run.config, 0, run.sample_shape)
    device = next(run.student.model.parameters()).device
    pairs = samples_to_train_pairs(rollout_shard(run.student.velocity, run.conds, plan, 0, device), plan.num_steps)
    ctx = HookContext(plan, run.config.dmd2, rank=0)
    with StepSyncs(run.critic) as critic:
        _, kept = train_steps(run.critic, CRITIC_HOOKS, ctx, pairs, plan.critic_steps)
    scores = score(run.teacher, kept, pairs, ctx, run.critic.velocity)
    with StepSyncs(run.student) as actor:
        train_steps(run.student, ACTOR_HOOKS, HookContext(plan, run.config.dmd2, 0, {"critic": scores}), pairs, 1)
    return critic, actor


@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_step_reads_nothing_back_between_the_forward_and_the_update(device):
    run = distiller(device)
    run.student, run.critic = fused(run.student), fused(run.critic)
    critic, actor = one_critic_and_one_actor_step(run)
    assert critic.closed and actor.closed  # both windows opened and closed: a forward, then a step
    assert critic.calls == [] and actor.calls == []


def test_an_unfused_step_reads_and_checks_its_figures_first():
    """The count sees what it is meant to: AdamW's default step (CPU) reads the loss and the grad norm, and checks
    them (on the host), before it updates."""
    critic, actor = one_critic_and_one_actor_step(distiller("cpu"))
    assert critic.calls == actor.calls == ["aten._local_scalar_dense.default"] * 3


def adam_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for p in model.parameters() for t in (p.detach(), *optimizer.state[p].values())]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_fused_step_that_is_not_finite_changes_nothing(bad):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = make_optimizer(model.parameters(), 0.1, (0.9, 0.999), 0.1, 0, fused=True)
    optimizer_step(model, optimizer, scheduler, model(torch.randn(4, 3)).square().mean(), 1.0)  # moments exist
    before, lr_steps = adam_state(model, optimizer), scheduler.last_epoch
    with pytest.raises(NonFiniteError, match="loss = (nan|inf)"):
        optimizer_step(model, optimizer, scheduler, model(torch.randn(4, 3)).square().mean() * bad, 1.0)
    for was, now in zip(before, adam_state(model, optimizer)):
        assert torch.equal(was, now)  # weights (weight decay included), both moments and the step count
    assert scheduler.last_epoch == lr_steps and all(p.grad is None for p in model.parameters())


def test_fused_and_unfused_steps_train_alike():
    losses = {}
    for is_fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer, scheduler = make_optimizer(model.parameters(), 0.1, (0.9, 0.999), 0.1, 0, fused=is_fused)
        data = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))
        losses[is_fused] = [optimizer_step(model, optimizer, scheduler, model(x).square().mean(), 1.0)["loss"]
                            for x in data]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][-1] < losses[True][0]

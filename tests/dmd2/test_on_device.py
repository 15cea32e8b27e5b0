"""On CUDA, a stage's model calls make no host round trip (docs/architecture.md §5: a stage moves its
inputs onto the device once and makes every tensor there): "Memcpy DtoH" events in torch.profiler's
CUDA trace, with a tiny digits UNet."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dmd2.conditioning import ClassLabels
from dmd2.config import DMD2Config
from dmd2.convert import TrainPairs
from dmd2.families.digits.model import build_digits_unet
from dmd2.hooks import CRITIC_HOOKS
from dmd2.model import DiffusersVelocity
from dmd2.optim import make_optimizer
from dmd2.plan import RolloutPlan
from dmd2.rollout import rollout_shard
from dmd2.tensors import to_device
from dmd2.trainer import HookContext, TrainState, train_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = (1, 8, 8)
BATCH = 4


def device_to_host_copies(work) -> list[str]:
    """The names of the device-to-host copies the GPU made while `work()` ran."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        work()
        torch.cuda.synchronize()
    return [event.name for event in trace.events() if "Memcpy DtoH" in event.name]


def plan(critic_steps: int, num_steps: int = 2) -> RolloutPlan:
    return RolloutPlan(seed=0, rollout_id=0, world_size=1, critic_steps=critic_steps, batch=BATCH,
                       sample_shape=SHAPE, num_steps=num_steps, shift=1.0)


def unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_digits_unet().cuda()


@pytest.mark.parametrize("num_steps", [2, 4])
def test_a_rollout_copies_nothing_back_to_the_host(num_steps):
    student, labels = DiffusersVelocity(unet().eval()), ClassLabels(10, 10)
    rollout_shard(student, labels, plan(2, num_steps), 0, device="cuda")  # warm-up: CUDA and cuDNN set-up
    made = []
    copies = device_to_host_copies(lambda: made.append(rollout_shard(student, labels, plan(2, num_steps), 0,
                                                                     device="cuda")))
    assert made[0].x0_hat.is_cuda and int(made[0].step_index.max()) > 0  # it ran on the GPU, several calls deep
    assert copies == [], copies


def pairs_on_cuda(n: int) -> TrainPairs:
    g = torch.Generator().manual_seed(0)
    pairs = TrainPairs(torch.randn(n, *SHAPE, generator=g), torch.randn(n, *SHAPE, generator=g), torch.rand(n),
                       torch.rand(n) * 1000, torch.zeros(n, dtype=torch.long),
                       {"class_labels": torch.randint(10, (n,), generator=g)}, {"class_labels": torch.full((n,), 10)},
                       torch.arange(n))
    return to_device(pairs, "cuda")


def test_critic_steps_copy_back_only_their_metrics():
    """Per optimizer step the same copies for K = 1 and K = 3 (the step's loss and grad norm, read as
    metrics), however many model calls the steps make."""
    model = unet().train()
    optimizer, scheduler = make_optimizer(model.parameters(), 1e-4, (0.0, 0.999), 0.0, 0)
    state = TrainState(model, DiffusersVelocity(model), optimizer, scheduler, grad_clip=1.0)
    pairs = pairs_on_cuda(3 * BATCH)
    train_steps(state, CRITIC_HOOKS, HookContext(plan(3), DMD2Config(), 0), pairs, 3)  # warm-up: AdamW's state
    per_step = {}
    for steps in (1, 3):
        ctx = HookContext(plan(steps), DMD2Config(), 0)
        copies = device_to_host_copies(lambda: train_steps(state, CRITIC_HOOKS, ctx, pairs, steps))
        per_step[steps] = len(copies) / steps
    assert per_step[1] == per_step[3], per_step
    assert per_step[1] <= 2, per_step  # optimizer_step reads loss and grad_norm, nothing else

"""A critic's checkpoint (infra/trainers/checkpoint.py) and sleep (offload.py) carry its GAN head: it is a
submodule of the critic (dmd2/gan.py), so a resumed critic takes the same next steps bit for bit."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dmd2.config import DistillConfig, DMD2Config, ModelConfig, OptimConfig, TrainConfig
from dmd2.families.digits.family import DigitsFamily
from dmd2.families.digits.model import build_digits_unet
from dmd2.gan import HEAD_NAME, RealSamples, attach_gan_head, tapped
from dmd2.hooks import CRITIC_HOOKS
from dmd2.model import DiffusersVelocity
from dmd2.plan import rollout_plan
from dmd2.trainer import HookContext, train_state, train_steps
from infra.store import ArtifactStore
from infra.trainers.checkpoint import load_checkpoint, save_checkpoint
from infra.trainers.offload import HostCopy, module_tensors, optimizer_tensors
from infra.trainers.parallel import free_port
from tests.dmd2.test_gan import pairs

SHAPE = (1, 8, 8)
CONFIG = DistillConfig(model=ModelConfig(teacher="tiny"), optim=OptimConfig(lr=1e-3, warmup_steps=2),
                       train=TrainConfig(rollout_batch_size=6),
                       dmd2=DMD2Config(critic_steps_per_rollout=2, gan_weight=3e-3, critic_gan_weight=0.5))
REAL = RealSamples(torch.rand(16, *SHAPE, generator=torch.Generator().manual_seed(3)) * 2 - 1,
                   {"class_labels": torch.arange(16) % 10})


def critic_state(seed: int):
    torch.manual_seed(seed)
    model = build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)
    model = attach_gan_head(model, DigitsFamily().gan_tap(model), seed=seed)
    return train_state(model, CONFIG.critic_lr, CONFIG, lambda m: tapped(DiffusersVelocity(m), m))


def critic_rollout(state, rollout_id: int) -> None:
    ctx = HookContext(rollout_plan(CONFIG, rollout_id, SHAPE), CONFIG.dmd2, rank=0, real=REAL)
    train_steps(state, CRITIC_HOOKS, ctx, pairs(6), CONFIG.dmd2.critic_steps_per_rollout)


def full_state(state) -> dict[str, torch.Tensor]:
    tensors = {f"model.{k}": v.clone() for k, v in state.model.state_dict().items()}
    names = {param: name for name, param in state.model.named_parameters()}
    for param, values in state.optimizer.state.items():
        tensors |= {f"optim.{names[param]}.{k}": v.clone() for k, v in values.items()}
    return tensors


def test_a_resumed_critic_with_its_gan_head_takes_the_same_next_steps_bitwise(tmp_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        store = ArtifactStore((tmp_path / "store").as_uri())
        first = critic_state(seed=0)
        critic_rollout(first, 0)
        ref = save_checkpoint(store, "run/checkpoints_critic/1", first.model, first.optimizer, first.scheduler, [],
                              {"role": "critic"}, None)
        critic_rollout(first, 1)

        resumed = critic_state(seed=1)  # another UNet and another head until the checkpoint loads
        assert not torch.equal(resumed.model.gan_head.out.weight, first.model.gan_head.out.weight)
        load_checkpoint(store, ref, "critic", resumed.model, resumed.optimizer, resumed.scheduler, rank=0)
        critic_rollout(resumed, 1)
    finally:
        dist.destroy_process_group()
    expected, got = full_state(first), full_state(resumed)
    assert got.keys() == expected.keys() and any(key.startswith(f"model.{HEAD_NAME}.") for key in got)
    assert any(key.startswith(f"optim.{HEAD_NAME}.") for key in got)  # the head trains in the critic's AdamW
    assert all(torch.equal(got[key], expected[key]) for key in expected), "the resumed critic drifted"
    metadata = json.loads(next(Path(tmp_path / "store").rglob("dcp_metadata.json")).read_text())
    assert f"model.{HEAD_NAME}.out.weight" in metadata["tensors"]


def test_a_sleeping_critic_parks_its_gan_head_and_wakes_bit_identical():
    state = critic_state(seed=0)
    critic_rollout(state, 0)
    before = full_state(state)
    head = list(state.model.get_submodule(HEAD_NAME).parameters())
    parked = HostCopy()
    parked.offload(module_tensors(state.model) + optimizer_tensors(state.optimizer))
    assert all(p.untyped_storage().nbytes() == 0 for p in head)
    assert all(state.optimizer.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in head)
    parked.restore()
    after = full_state(state)
    assert all(torch.equal(after[key], before[key]) for key in before)


def test_a_student_whose_ema_went_non_finite_is_not_checkpointed(tmp_path):
    from dmd2.ema import ParameterEMA
    from dmd2.failures import NonFiniteError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        store = ArtifactStore((tmp_path / "store").as_uri())
        state = critic_state(seed=0)
        ema = ParameterEMA(state.model, decay=0.9)
        ema.state_dict()["conv_in.weight"].view(-1)[3] = float("inf")
        with pytest.raises(NonFiniteError, match="EMA of conv_in.weight"):
            save_checkpoint(store, "run/checkpoints/1", state.model, state.optimizer, state.scheduler, [],
                            {"role": "actor"}, None, ema)
        assert not list((tmp_path / "store").rglob("*.distcp"))  # nothing of it was written
    finally:
        dist.destroy_process_group()

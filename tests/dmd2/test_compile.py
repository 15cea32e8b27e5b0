"""`[train] compile`: the blocks a rank holds are compiled (inductor, as on a GPU), and train the same student; on
CUDA, bf16 critic steps lose the same as eager ones.

Student and critic go through `held_model`, the call every rank makes, and train in the in-process loop; the
baseline is the same run eager. The digits recipe's learning rates: AdamW turns any difference in a near-zero
gradient into a step of the full learning rate, so the tolerance is set by the recipe's rate, not the test's.
"""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from torch._dynamo.utils import counters

from dmd2.conditioning import ClassLabels
from dmd2.config import load_recipe
from dmd2.families.digits.model import build_digits_unet
from dmd2.hooks import CRITIC_HOOKS
from dmd2.loop import InProcessDistiller
from dmd2.trainer import HookContext, train_state, train_steps
from infra.trainers.models import held_model
from infra.trainers.parallel import shard_units
from tests import background

RECIPE = Path(__file__).parents[2] / "recipes" / "digits-1step.toml"
SAMPLE_SHAPE = (1, 8, 8)
# Inductor's compilation of this run (~50 s of CPU on 2 cores) goes into its cache beside the suite's first tests
# (tests/background.py), as a cluster's shared cache would hold it; the test then compiles the same graphs from
# that cache, and checks what it checked before. The cache's key holds the thread count: the job takes the suite's.
BACKGROUND_JOBS = {"inductor cache of the compiled run": f"""
import sys, torch
from pathlib import Path
from tests.dmd2.test_compile import distill
torch.set_num_threads({torch.get_num_threads()})
distill(Path(sys.argv[1]), compile=True)
"""}


def tiny_teacher(tmp_path: Path):
    torch.manual_seed(0)
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(tmp_path / "teacher")
    return AutoModel.from_pretrained(str(tmp_path / "teacher"))


def recipe(compile: bool):
    return load_recipe(RECIPE, {"train": {"rollouts": 3, "rollout_batch_size": 12, "compile": compile},
                                "dmd2": {"critic_steps_per_rollout": 1}})


def distill(tmp_path: Path, compile: bool) -> InProcessDistiller:
    config, teacher = recipe(compile), tiny_teacher(tmp_path)
    student, critic = (held_model(copy.deepcopy(teacher).requires_grad_(True), config) for _ in range(2))
    distiller = InProcessDistiller.from_models(config, teacher, ClassLabels(10, 10), SAMPLE_SHAPE, student=student,
                                               critic=critic)
    distiller.run(range(config.train.rollouts))
    return distiller


def samples(distiller: InProcessDistiller) -> torch.Tensor:
    """The trained student's one-step samples of a fixed batch of noise, every class and then some: a batch of the
    rollouts' size, which the compiled blocks already hold graphs for (another size is another compilation)."""
    batch = distiller.config.train.rollout_batch_size
    noise = torch.randn((batch, *SAMPLE_SHAPE), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return distiller.student.velocity(noise, torch.ones(batch), {"class_labels": torch.arange(batch) % 10})


@pytest.mark.slow  # inductor compiles each block's graphs (~50 s on 2 cores, ~10 s from its cache)
@pytest.mark.waits_for("inductor cache of the compiled run")
def test_a_compiled_student_trains_as_the_eager_one_within_1e_4(tmp_path):
    background.wait("inductor cache of the compiled run")
    eager = distill(tmp_path, compile=False)
    frames_before = counters["frames"]["ok"]
    compiled = distill(tmp_path, compile=True)

    assert counters["frames"]["ok"] > frames_before  # dynamo compiled frames during the run
    for model in (compiled.student.model, compiled.critic.model):
        assert all(block._compiled_call_impl is not None for block in shard_units(model))
    for model in (eager.student.model, eager.critic.model):
        assert all(block._compiled_call_impl is None for block in shard_units(model))

    trained = eager.student.model.state_dict()
    teacher = tiny_teacher(tmp_path).state_dict()
    assert max((trained[name] - teacher[name]).abs().max() for name in trained) > 1e-4  # it did train
    for name, weight in compiled.student.model.state_dict().items():
        torch.testing.assert_close(weight, trained[name], rtol=0, atol=1e-4, msg=name)
    torch.testing.assert_close(samples(compiled), samples(eager), rtol=0, atol=1e-4)


def test_a_model_on_fake_tensors_stays_eager(tmp_path):
    """`dmd2 plan` holds its models on fake tensors: nothing there can be compiled, and the plan stays eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)
    held = held_model(model, recipe(compile=True))
    assert all(block._compiled_call_impl is None for block in shard_units(held))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_compiled_critic_steps_give_the_eager_losses_within_bf16_tolerance():
    from tests.dmd2.test_on_device import BATCH, pairs_on_cuda, plan

    config = load_recipe(RECIPE, {"train": {"mixed_precision": "bf16"}})
    losses = {}
    for compile in (False, True):
        torch.manual_seed(0)
        model = build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).cuda()
        model = held_model(model, dataclasses.replace(config, train=dataclasses.replace(config.train, compile=compile)))
        state = train_state(model, 1e-4, config)
        ctx, pairs = HookContext(plan(3), config.dmd2, 0), pairs_on_cuda(3 * BATCH)
        with torch.autocast("cuda", torch.bfloat16):
            metrics, _ = train_steps(state, CRITIC_HOOKS, ctx, pairs, 3)
        losses[compile] = [step["loss"] for step in metrics]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)  # bf16's 8-bit mantissa, over three steps


def test_compile_with_activation_checkpointing_is_refused_naming_both_options():
    from dmd2.config import ConfigError

    with pytest.raises(ConfigError, match=r"\[train\] compile .* activation_checkpointing"):
        load_recipe(RECIPE, {"train": {"compile": True, "activation_checkpointing": True}})

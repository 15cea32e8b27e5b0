"""Sharded checkpoints of a LoRA model (infra/trainers/sharded.py with dmd2/lora.py): they hold the
adapters and their AdamW state only, and a run resumed from one (the init's frozen weights loaded
anew, adapters injected, the checkpoint loaded) takes bitwise the same next steps."""

import copy
import json

import pytest
import torch

from dmd2.families.digits.family import DigitsFamily
from dmd2.families.digits.model import build_digits_unet
from dmd2.lora import add_adapters
from dmd2.optim import make_optimizer
from infra.trainers.sharded import METADATA_NAME, load_sharded, save_sharded


def teacher():
    torch.manual_seed(0)
    return build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)


def adapted(seed: int, lr: float = 1e-2):
    model = add_adapters(teacher(), 4, 4, DigitsFamily.lora_targets, seed=seed)
    optimizer, _ = make_optimizer([p for p in model.parameters() if p.requires_grad], lr, (0.0, 0.999), 0.01, 0)
    return model, optimizer


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, labels = torch.randn(4, 1, 8, 8, generator=generator), torch.randint(11, (4,), generator=generator)
        model(x, torch.full((4,), 500.0), class_labels=labels).sample.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def everything(model, optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    state |= {f"optim.{i}.{k}": v.clone() for i, values in optimizer.state_dict()["state"].items()
              for k, v in values.items()}
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lora_checkpoint_holds_only_the_adapters_and_resumes_bitwise(tmp_path):
    model, optimizer = adapted(seed=1)
    train(model, optimizer, range(2))
    save_sharded(tmp_path / "ckpt", model, optimizer)
    train(model, optimizer, range(2, 4))

    saved = json.loads((tmp_path / "ckpt" / METADATA_NAME).read_text())["tensors"]
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {key.removeprefix("model.") for key in saved if key.startswith("model.")} == adapters
    assert all(".lora_A." in key or ".lora_B." in key for key in saved)  # optimizer state: the adapters' only
    assert {key.split(".")[-1] for key in saved if key.startswith("optim.")} == {"step", "exp_avg", "exp_avg_sq"}

    resumed, resumed_optimizer = adapted(seed=2, lr=0.5)  # other adapters and lr: the load must set them all
    load_sharded(tmp_path / "ckpt", resumed, resumed_optimizer)
    train(resumed, resumed_optimizer, range(2, 4))
    expected, found = everything(model, optimizer), everything(resumed, resumed_optimizer)
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(found[key], value), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_lora_checkpoint_does_not_load_into_a_fully_trained_model(tmp_path):
    model, optimizer = adapted(seed=1)
    train(model, optimizer, range(1))
    save_sharded(tmp_path / "ckpt", model, optimizer)
    full = copy.deepcopy(teacher())
    full_optimizer, _ = make_optimizer(full.parameters(), 1e-2, (0.0, 0.999), 0.0, 0)
    with pytest.raises(ValueError, match="param_groups hold other parameters than the saved ones"):
        load_sharded(tmp_path / "ckpt", full, full_optimizer)

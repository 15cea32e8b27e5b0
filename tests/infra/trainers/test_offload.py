"""Sleep/wake storage parking (infra/trainers/offload.py), on CPU without Ray."""

import numpy as np
import pytest
import torch

from dmd2.model import load_pretrained
from dmd2.optim import make_optimizer
from infra.trainers.offload import HostCopy, module_tensors, optimizer_tensors, own_storage


def test_offload_frees_storages_and_restore_is_bit_identical():
    torch.manual_seed(0)
    model = own_storage(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))
    optimizer, scheduler = make_optimizer(model.parameters(), 1e-2, (0.0, 0.999), 0.0, 0)
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    params = list(model.parameters())
    before = [t.clone() for t in module_tensors(model) + optimizer_tensors(optimizer)]
    parked = HostCopy()
    moved = parked.offload(module_tensors(model) + optimizer_tensors(optimizer))
    assert moved == sum(t.numel() * t.element_size() for t in before)
    assert all(t.untyped_storage().nbytes() == 0 for t in module_tensors(model))
    parked.restore()
    after = module_tensors(model) + optimizer_tensors(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert list(model.parameters())[0] is params[0]  # the same tensors: optimizer and DDP keep their references
    assert not parked.parked


def test_shared_storage_is_parked_once():
    weight = torch.nn.Parameter(torch.randn(5))
    view = weight.detach()[1:3]
    parked = HostCopy()
    assert parked.offload([weight, view]) == 5 * 4
    parked.restore()
    assert torch.equal(view, weight.detach()[1:3])


def test_a_tensor_that_cannot_be_parked_is_refused_with_every_other_left_in_place():
    """A storage over a numpy array cannot shrink: offload names the fix, and frees nothing before it knows."""
    kept, fixed = torch.arange(6.0), torch.from_numpy(np.arange(4.0))
    parked = HostCopy()
    with pytest.raises(RuntimeError, match="own_storage"):
        parked.offload([kept, fixed])
    assert torch.equal(kept, torch.arange(6.0)) and not parked.parked
    assert parked.offload([kept]) == 6 * 4  # the same HostCopy serves again


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (torch.equal alone takes 0.0 and -0.0 for equal)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_loaded_in_its_dtype_sleeps_and_wakes_bit_exactly(tmp_path, dtype):
    from diffusers import UNet2DModel
    from safetensors.torch import load_file

    torch.manual_seed(0)
    UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(16, 32), layers_per_block=1,
                down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                norm_num_groups=8, num_class_embeds=11).save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(tmp_path / "diffusion_pytorch_model.safetensors")
    loaded = load_pretrained(str(tmp_path), dtype)
    if dtype is None:  # weights that need no cast stay in the file mapping: the storages own_storage replaces
        assert not all(tensor.untyped_storage().resizable() for tensor in module_tensors(loaded))
    model = own_storage(loaded)
    parked = HostCopy()
    parked.offload(module_tensors(model))
    assert all(tensor.untyped_storage().nbytes() == 0 for tensor in module_tensors(model))
    parked.restore()
    state = model.state_dict()
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(bits(state[name]), bits(tensor.to(dtype or torch.float32))), name

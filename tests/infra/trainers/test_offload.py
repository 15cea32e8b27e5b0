"""Sleep/wake storage parking (infra/trainers/offload.py), on CPU without Ray."""

import torch

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

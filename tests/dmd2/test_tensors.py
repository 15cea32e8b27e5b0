import torch

from dmd2.convert import TrainPairs
from dmd2.tensors import from_tensor_dict, to_device, to_tensor_dict


def pairs() -> TrainPairs:
    n = 3
    return TrainPairs(latent=torch.randn(n, 1, 2, 2), x0=torch.randn(n, 1, 2, 2), sigma=torch.rand(n),
                      timestep=torch.rand(n) * 1000, step_index=torch.zeros(n, dtype=torch.long),
                      cond={"class_labels": torch.arange(n)},
                      neg_cond={"class_labels": torch.full((n,), 10)}, sample_index=torch.tensor([4, 5, 6]))


def test_to_device_moves_every_tensor_but_the_sample_index_which_stays_on_the_host():
    record = pairs()
    moved = to_device(record, "meta")  # a device without data: any tensor left behind would show
    assert moved.latent.device.type == moved.cond["class_labels"].device.type == "meta"
    assert moved.sample_index.device.type == "cpu" and torch.equal(moved.sample_index, record.sample_index)


def test_a_record_survives_its_flat_tensor_dict():
    record = pairs()
    back = from_tensor_dict(TrainPairs, to_tensor_dict(record))
    assert all(torch.equal(getattr(back, f), getattr(record, f)) for f in ("latent", "x0", "sigma", "sample_index"))
    assert torch.equal(back.cond["class_labels"], record.cond["class_labels"])

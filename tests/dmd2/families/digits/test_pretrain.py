import pytest
import torch
from diffusers import AutoModel

from dmd2.families.digits.data import load_digits_splits
from dmd2.families.digits.pretrain import PretrainConfig, cached_teacher

TINY = PretrainConfig(steps=4, batch_size=16)


def test_pretraining_is_cached_and_loads_through_from_pretrained(tmp_path):
    splits = load_digits_splits()
    steps = []
    path = cached_teacher(tmp_path, splits, TINY, lambda step, loss: steps.append(step))
    assert steps == [0, 1, 2, 3]
    again = cached_teacher(tmp_path, splits, TINY, lambda step, loss: steps.append(step))
    assert again == path and len(steps) == 4  # the second call trained nothing
    model = AutoModel.from_pretrained(str(path))
    assert model.config.num_class_embeds == 11


def test_pretraining_is_seeded(tmp_path):
    splits = load_digits_splits()
    a = AutoModel.from_pretrained(str(cached_teacher(tmp_path / "a", splits, TINY)))
    b = AutoModel.from_pretrained(str(cached_teacher(tmp_path / "b", splits, TINY)))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_an_interrupted_pretraining_leaves_no_cache_entry(tmp_path):
    def crash(step, loss):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_teacher(tmp_path, load_digits_splits(), TINY, crash)
    assert not any(tmp_path.glob("digits-teacher-*"))

import numpy as np
import pytest
import torch

from dmd2.families.digits.model import build_digits_unet
from flows.cli import main


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("sampler, steps", [("student", 4), ("teacher", 3), ("student", 1)])
def test_sample_writes_an_npz_any_evaluator_can_score(tmp_path, model_dir, sampler, steps):
    out = tmp_path / "s.npz"
    assert main(["sample", "--model", str(model_dir), "--steps", str(steps), "--sampler", sampler,
                 "--num-samples", "25", "--guidance", "2", "--out", str(out)]) == 0
    data = np.load(out)
    assert data["images"].dtype == np.float32 and data["images"].shape == (25, 1, 8, 8)
    assert data["images"].min() >= -1 and data["images"].max() <= 1
    assert data["labels"].dtype == np.int64 and data["labels"].tolist() == [i % 10 for i in range(25)]


def test_sample_rejects_bad_steps_and_writes_nothing(tmp_path, model_dir):
    out = tmp_path / "s.npz"
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        main(["sample", "--model", str(model_dir), "--steps", "0", "--out", str(out)])
    assert not out.exists()

"""Atomic local writes keep the user's umask: what they leave is as readable as a plain open() or mkdir()."""

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from dmd2.families.digits.model import build_digits_unet
from dmd2.files import atomic_dir, atomic_file


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_atomic_file_gets_the_mode_a_plain_open_gives(umask, tmp_path):
    with open(tmp_path / "plain", "wb"):
        pass
    with atomic_file(tmp_path / "samples.png") as tmp:
        tmp.write_bytes(b"png")
    assert (tmp_path / "samples.png").read_bytes() == b"png"
    assert _mode(tmp_path / "samples.png") == _mode(tmp_path / "plain") == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "samples.png"]  # no staging left


def test_an_atomic_dir_gets_the_mode_a_plain_mkdir_gives(umask, tmp_path):
    (tmp_path / "plain").mkdir()
    with atomic_dir(tmp_path / "teacher") as staging:
        (staging / "config.json").write_text("{}")
    assert _mode(tmp_path / "teacher") == _mode(tmp_path / "plain") == 0o777 & ~umask
    assert _mode(tmp_path / "teacher" / "config.json") == 0o666 & ~umask


def test_what_a_library_saves_privately_gets_the_mode_a_plain_open_gives(umask, tmp_path):
    """safetensors >= 0.8 saves through a 0600 temporary file of its own (safetensors#782), and so does every
    save_pretrained: a cached teacher or evaluator would be readable by its owner alone."""
    with atomic_file(tmp_path / "evaluator.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp))
    with atomic_dir(tmp_path / "teacher") as staging:
        build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(staging / "unet")
        (staging / "run.sh").write_text("#!/bin/sh\n")
        (staging / "run.sh").chmod(0o755)
    assert _mode(tmp_path / "evaluator.safetensors") == 0o666 & ~umask
    assert _mode(tmp_path / "teacher" / "unet") == 0o777 & ~umask
    assert {path.name: _mode(path) for path in (tmp_path / "teacher" / "unet").iterdir()} == {
        "config.json": 0o666 & ~umask, "diffusion_pytorch_model.safetensors": 0o666 & ~umask}
    assert _mode(tmp_path / "teacher" / "run.sh") == 0o777 & ~umask  # an executable stays one


def test_a_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "out.npz") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []

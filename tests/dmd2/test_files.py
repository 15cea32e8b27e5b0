"""Atomic local writes keep the user's umask: what they leave is as readable as a plain open() or mkdir()."""

import os
import stat

import pytest

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


def test_a_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "out.npz") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []

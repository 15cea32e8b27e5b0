"""Tests of the digests (infra/store/io.py) and `python -m infra.store`: the store keeps the plain sha256 of every
object, what `sha256sum` prints; stores written before manifest format v2 (a piece-wise digest) still read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.store import ArtifactRef, ArtifactStore, IntegrityError
from infra.store.io import file_sha256, legacy_sha256, sha256_hex
from tests.infra.store.digest_reference import PIECE, legacy_digest, reference_digest

# Empty, shorter than a piece, exactly one, one byte either side of a boundary, several.
SIZES = [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345]
RUN = "run-1"


@pytest.mark.parametrize("size", SIZES)
def test_digests_match_the_references(size, tmp_path):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert sha256_hex(data) == file_sha256(tmp_path / "f") == reference_digest(data)
    assert legacy_sha256(data) == file_sha256(tmp_path / "f", legacy=True) == legacy_digest(data)


def test_the_command_line_prints_what_sha256sum_prints(tmp_path):
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum here")
    files = [tmp_path / "a.bin", tmp_path / "empty", tmp_path / "big.bin"]
    for path, size in zip(files, (PIECE + 3, 0, 3 * PIECE + 7)):
        path.write_bytes(os.urandom(size))
    ours = subprocess.run([sys.executable, "-m", "infra.store", *map(str, files)],
                          capture_output=True, text=True, check=True)
    theirs = subprocess.run(["sha256sum", *map(str, files)], capture_output=True, text=True, check=True)
    assert ours.stdout == theirs.stdout and len(ours.stdout.splitlines()) == 3
    missing = subprocess.run([sys.executable, "-m", "infra.store", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "nope" in missing.stderr


def test_refs_and_manifests_hold_what_sha256sum_prints(tmp_path):
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum here")
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    key = store.rollout_key(RUN, 0, "actor", 0)
    ref = store.put_tensors(key, {"x": torch.randn(1000)})
    source = tmp_path / "src"
    source.mkdir()
    (source / "w.bin").write_bytes(os.urandom(PIECE + 5))
    directory = store.put_dir(store.checkpoint_key(RUN, 1), source)
    stored = tmp_path / "store"
    manifest = stored / RUN / "checkpoints" / "1" / "MANIFEST.json"
    printed = subprocess.run(["sha256sum", str(stored / key), str(source / "w.bin"), str(manifest)],
                             capture_output=True, text=True, check=True).stdout.split()[::2]
    entry = json.loads(manifest.read_text())["files"][0]
    assert [ref.sha256, entry["sha256"], directory.sha256] == printed


def _write_the_old_way(folder: Path, files: dict[str, bytes]) -> str:
    """A directory as stores before manifest v2 wrote it: piece-wise digests in a v1 manifest. Returns the
    manifest's own (piece-wise) digest, as the old ref held it."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    entries = [{"path": name, "nbytes": len(data), "sha256": legacy_digest(data)} for name, data in sorted(files.items())]
    manifest = json.dumps({"format": "dmd2-flows/manifest-v1", "files": entries}, sort_keys=True, indent=1).encode()
    (folder / "MANIFEST.json").write_bytes(manifest)
    return legacy_digest(manifest)


def test_a_store_written_the_old_way_still_reads_and_still_catches_damage(tmp_path):
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    tensors = {"x": torch.randn(300_000)}  # > 1 MiB: more than one legacy piece
    key = store.rollout_key(RUN, 0, "actor", 0)
    path = tmp_path / "store" / key
    path.parent.mkdir(parents=True)
    store.put_tensors(key, tensors)
    data = path.read_bytes()
    old_ref = ArtifactRef(store.uri(key), legacy_digest(data), len(data), "tensors")
    assert old_ref.sha256 != reference_digest(data)
    assert torch.equal(store.get_tensors(old_ref)["x"], tensors["x"])

    files = {"a.bin": os.urandom(2 * PIECE + 1), "b.json": b"{}"}
    checkpoint = tmp_path / "store" / RUN / "checkpoints" / "3"
    old_dir = ArtifactRef(store.uri(f"{RUN}/checkpoints/3"), _write_the_old_way(checkpoint, files),
                          sum(map(len, files.values())), "dir")
    assert store.latest_checkpoint(RUN).step == 3
    found = store.find_dir(f"{RUN}/checkpoints/3")  # a ref made today names the manifest's plain sha256
    for ref in (old_dir, found):
        fetched = store.get_dir(ref, tmp_path / f"out-{ref.sha256[:8]}")
        assert {p.name: p.read_bytes() for p in fetched.iterdir()} == files
    assert store.put_dir(f"{RUN}/checkpoints/3", fetched) == found  # the same files again: no new write

    with open(checkpoint / "a.bin", "r+b") as file:  # damage is still damage
        file.seek(PIECE + 9)
        file.write(bytes([file.read(1)[0] ^ 1]))
    with pytest.raises(IntegrityError, match="a.bin"):
        store.get_dir(old_dir, tmp_path / "damaged")
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IntegrityError):
        store.get_tensors(old_ref)

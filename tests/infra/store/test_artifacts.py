"""Tests of infra/store/artifacts.py: every store behaviour runs on file:// and on a real S3 API (moto)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

import botocore.exceptions
import pytest
import safetensors.torch
import torch

from infra.store import io as store_io
from infra.store import s3 as store_s3
from infra.store import (
    ArtifactExistsError,
    ArtifactRef,
    ArtifactStore,
    IntegrityError,
    StoreAccessError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from infra.store.artifacts import STALE_STAGING_S
from infra.store.faults import s3_error
from infra.store.io import hidden_sibling
from tests.infra.conftest import BUCKET, s3_client
from tests.infra.store.digest_reference import PIECE, reference_digest

REPO_ROOT = Path(__file__).resolve().parents[3]
RUN = "run-1"
# Every dtype safetensors writes (its table, safetensors.torch._TYPES, less the fnuz float8s).
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32,
          torch.uint16, torch.uint8, torch.bool]
# botocore's debug line before each retry of a request (botocore/retries/standard.py).
RETRY_LOG = "Retry needed"


def assert_bitwise_equal(expected: dict, actual: dict) -> None:
    """Same names, dtypes, shapes and bytes (NaN payloads and -0.0 included)."""
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(_raw_bytes(got), _raw_bytes(tensor)), name


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    return {
        "fp32": torch.cat([torch.randn(1000, generator=generator), special]).reshape(5, 201),
        "bf16": torch.cat([torch.randn(16, generator=generator), special]).to(torch.bfloat16),
        "fp16": torch.cat([torch.randn(64, generator=generator), special]).to(torch.float16),
        "int64": torch.tensor([0, -1, 2**62, -(2**63), 2**63 - 1]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor of each dtype the store writes, of odd lengths (alignment must not depend on
    the order of the names) and random bytes (NaN payloads and subnormals included)."""
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for index, dtype in enumerate(DTYPES):
        count = 2 * index + 1
        if dtype is torch.bool:
            tensors["bool"] = torch.randint(0, 2, (count,), generator=generator).bool()
            continue
        size = (count * dtype.itemsize,)
        raw = torch.randint(0, 256, size, dtype=torch.uint8, generator=generator)
        tensors[str(dtype).removeprefix("torch.")] = raw.view(dtype)
    return tensors


def make_source_dir(path: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """A folder of files with random contents: {relative path: size in bytes}."""
    generator = torch.Generator().manual_seed(seed)
    for rel_path, size in sizes.items():
        target = path / rel_path
        target.parent.mkdir(parents=True, exist_ok=True)
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        target.write_bytes(data.numpy().tobytes())
    return path


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


# -- references ----------------------------------------------------------------------------------


def test_ref_round_trips_through_json_and_dict():
    ref = ArtifactRef("file:///a/b.safetensors", "0" * 64, 12, "tensors")
    assert ArtifactRef.from_json(ref.to_json()) == ref
    assert ArtifactRef.from_dict(ref.to_dict()) == ref
    assert pickle.loads(pickle.dumps(ref)) == ref
    with pytest.raises(AttributeError):
        ref.uri = "file:///elsewhere"  # frozen


@pytest.mark.parametrize(
    "fields",
    [
        {"uri": "no-scheme", "sha256": "0" * 64, "nbytes": 1, "kind": "json"},
        {"uri": "file:///a", "sha256": "XYZ", "nbytes": 1, "kind": "json"},
        {"uri": "file:///a", "sha256": "0" * 64, "nbytes": -1, "kind": "json"},
        {"uri": "file:///a", "sha256": "0" * 64, "nbytes": 1, "kind": "pickle"},
    ],
)
def test_ref_refuses_bad_fields(fields):
    with pytest.raises(ValueError):
        ArtifactRef(**fields)
    with pytest.raises(ValueError):
        ArtifactRef.from_dict({**fields, "extra": 1})


# -- round trips ---------------------------------------------------------------------------------


def test_tensor_round_trip_is_bitwise(store_target):
    store = ArtifactStore(store_target.root_uri)
    tensors = sample_tensors()
    key = store.rollout_key(RUN, 3, "critic", 1)
    ref = store.put_tensors(key, tensors)
    assert ref.uri == f"{store.root_uri}/{RUN}/rollout-3/critic/rank-1.safetensors"
    assert ref.kind == "tensors" and ref.nbytes > 0
    assert_bitwise_equal(tensors, store.get_tensors(ref))
    # A ref that went through JSON (as Prefect persists it) reads the same.
    assert_bitwise_equal(tensors, store.get_tensors(ArtifactRef.from_json(ref.to_json())))


@pytest.mark.parametrize("durable, fsyncs", [(True, 2), (False, 0)])
def test_durable_writes_wait_for_the_disk_and_others_do_not(store_target, monkeypatch, durable, fsyncs):
    """A durable write fsyncs the file and its folder's rename; a rollout payload's (not durable) does
    neither. Both read back bitwise, their digest checked."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    store = ArtifactStore(store_target.root_uri)
    tensors = sample_tensors()
    ref = store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), tensors, durable=durable)
    assert len(synced) == (fsyncs if store_target.scheme == "file" else 0)
    assert_bitwise_equal(tensors, store.get_tensors(ref))


def test_every_dtype_round_trips(store_target):
    store = ArtifactStore(store_target.root_uri)
    tensors = every_dtype()
    ref = store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), tensors)
    assert_bitwise_equal(tensors, store.get_tensors(ref))


def test_stored_tensors_are_plain_aligned_safetensors(tmp_path):
    """The store writes safetensors with safetensors' own writer: its reader loads the file, every tensor
    starts at a multiple of its element size, and the ref holds the file's plain sha256."""
    store = ArtifactStore(f"file://{tmp_path}")
    tensors = {**every_dtype(), **sample_tensors()}
    key = store.rollout_key(RUN, 0, "actor", 0)
    ref = store.put_tensors(key, tensors)
    data = (tmp_path / key).read_bytes()
    assert ref.nbytes == len(data) and ref.sha256 == reference_digest(data)
    assert_bitwise_equal(tensors, safetensors.torch.load_file(tmp_path / key))
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert header_end % 8 == 0
    for name, entry in json.loads(data[8:header_end]).items():
        assert (header_end + entry["data_offsets"][0]) % tensors[name].element_size() == 0, name


_BASE = torch.arange(8.0)


@pytest.mark.parametrize(
    "tensors, error",
    [
        ({"t": torch.zeros(3, 4).t()}, "non contiguous"),
        ({"t": torch.zeros(4).to_sparse()}, "sparse"),
        ({"t": torch.zeros(2, dtype=torch.complex128)}, "dtype"),
        ({"__metadata__": torch.zeros(2)}, "__metadata__"),
        ({"a": _BASE[2:6], "b": _BASE[:3]}, "share memory"),
        ({"a": _BASE[:4], "b": _BASE[1:2], "c": _BASE[6:]}, "share memory"),
    ],
)
def test_put_tensors_refuses_what_safetensors_refuses(tmp_path, tensors, error):
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    with pytest.raises(ValueError, match=error):
        store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), tensors)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_disjoint_views_of_one_tensor_are_stored(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    tensors = {"a": _BASE[:3], "b": _BASE[3:], "empty": _BASE[3:3]}
    ref = store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), tensors)
    assert_bitwise_equal(tensors, store.get_tensors(ref))


def test_large_tensors_stream_to_and_from_s3_in_parts(s3_target, monkeypatch):
    """A large put_tensors is a multipart upload (S3 marks a multipart object's ETag with '-<parts>'), and
    the object is the same file, same digest; a flipped byte anywhere in it is caught."""
    monkeypatch.setattr(store_s3, "_UPLOAD_BLOCK_BYTES", 5 * 2**20)  # S3's smallest part
    store = ArtifactStore(s3_target.root_uri)
    tensors = {"big": torch.randn(3_000_000), "small": torch.arange(10)}  # ~12 MB
    key = store.rollout_key(RUN, 0, "actor", 0)
    ref = store.put_tensors(key, tensors)
    data = s3_target.read_raw(key)
    assert "-" in s3_client().head_object(Bucket=BUCKET, Key=f"{s3_target.prefix}/{key}")["ETag"]
    assert ref.nbytes == len(data) and ref.sha256 == reference_digest(data)
    assert_bitwise_equal(tensors, safetensors.torch.load(data))
    assert_bitwise_equal(tensors, store.get_tensors(ref))
    s3_target.flip_byte(key, 5 * PIECE + 3)  # in the second part
    with pytest.raises(IntegrityError):
        store.get_tensors(ref)


def test_files_of_safetensors_own_writer_are_read(tmp_path):
    """Files written by save_file (as any safetensors writer) load."""
    store = ArtifactStore(f"file://{tmp_path}")
    tensors = {**every_dtype(), **sample_tensors()}
    key = store.rollout_key(RUN, 0, "actor", 0)
    path = tmp_path / key
    path.parent.mkdir(parents=True)
    safetensors.torch.save_file(tensors, path)
    data = path.read_bytes()
    ref = ArtifactRef(store.uri(key), reference_digest(data), len(data), "tensors")
    assert_bitwise_equal(tensors, store.get_tensors(ref))


def _file_with_header(header: object, data: bytes, length: int | None = None) -> bytes:
    encoded = json.dumps(header).encode() if not isinstance(header, bytes) else header
    encoded += b" " * (-len(encoded) % 8)
    return (len(encoded) if length is None else length).to_bytes(8, "little") + encoded + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "contents, error",
    [
        (b"\x01\x00", "header too small"),
        (_file_with_header({}, b"", length=1000), "invalid header length"),
        (_file_with_header(b"not json", b""), "invalid JSON"),
        (_file_with_header(b"\xff\xfe", b""), "invalid UTF-8"),
        (_file_with_header([1, 2], b""), "invalid type: sequence"),
        (_file_with_header({"a": _entry("F33", [1], 0, 4)}, bytes(4)), "unknown variant"),
        (_file_with_header({"a": {"dtype": "F32"}}, bytes(4)), "missing field"),
        (_file_with_header({"a": _entry("F32", [-1], 0, 4)}, bytes(4)), "integer `-1`"),
        (_file_with_header({"a": _entry("F32", [True], 0, 4)}, bytes(4)), "boolean"),
        (_file_with_header({"a": _entry("F32", [2], 0, 4)}, bytes(4)), "invalid shape"),
        (_file_with_header({"a": _entry("F32", [1], 4, 8)}, bytes(8)), "invalid offset"),
        (_file_with_header({"a": _entry("F32", [1], 0, 4)}, bytes(8)), "not fully covered"),
    ],
)
def test_verified_bytes_that_are_not_safetensors_are_refused(tmp_path, contents, error):
    """The header is checked by safetensors' loader, even on bytes that match their ref (a ref forged by
    someone who can write the store): never a tensor out of bounds, and a clear error naming the object."""
    store = ArtifactStore(f"file://{tmp_path}")
    key = store.rollout_key(RUN, 0, "actor", 0)
    path = tmp_path / key
    path.parent.mkdir(parents=True)
    path.write_bytes(contents)
    digest = reference_digest(contents)
    ref = ArtifactRef(store.uri(key), digest, len(contents), "tensors")
    with pytest.raises(ValueError, match=f"{key} is not a safetensors file: .*{error}"):
        store.get_tensors(ref)


def test_a_tensor_not_aligned_to_its_element_size_loads_whole(tmp_path):
    """safetensors' loader copies each tensor out of the file's bytes, so an odd offset is read right."""
    store = ArtifactStore(f"file://{tmp_path}")
    key = store.rollout_key(RUN, 0, "actor", 0)
    value = torch.tensor([1.5])
    contents = _file_with_header({"a": _entry("U8", [1], 0, 1), "b": _entry("F32", [1], 1, 5)},
                                 bytes([7]) + value.numpy().tobytes())
    (tmp_path / key).parent.mkdir(parents=True)
    (tmp_path / key).write_bytes(contents)
    ref = ArtifactRef(store.uri(key), reference_digest(contents), len(contents), "tensors")
    assert_bitwise_equal({"a": torch.tensor([7], dtype=torch.uint8), "b": value}, store.get_tensors(ref))


def test_json_round_trip(store_target):
    store = ArtifactStore(store_target.root_uri)
    value = {"loss": 0.25, "steps": [1, 2, 3], "name": "dmd2", "nested": {"ok": True}}
    ref = store.put_json(f"{RUN}/rollout-0/metrics.json", value)
    assert store.get_json(ref) == value


def test_conditional_writes_only_touch_the_version_that_was_read(store_target):
    store = ArtifactStore(store_target.root_uri)
    key = f"{RUN}/state.json"
    assert store.read_versioned(key) is None
    assert store.replace_if(key, b"x", "any") is None and not store.delete_if(key, "any")
    assert store.replace_if("no-such-run/state.json", b"x", "any") is None
    first = store.create_if_absent(key, b"first")
    assert first and store.create_if_absent(key, b"second") is None
    assert store.read_versioned(key) == (b"first", first)

    second = store.replace_if(key, b"second", first)
    assert second and second != first and store.read_versioned(key) == (b"second", second)
    assert store.replace_if(key, b"stale", first) is None  # a swap on a version read before
    assert not store.delete_if(key, first)
    assert store_target.read_raw(key) == b"second"
    assert store.delete_if(key, second) and store.read_versioned(key) is None
    assert store.create_if_absent(key, b"again")
    assert [k for k in store_target.raw_keys() if not k.split("/")[-1].startswith(".")] == [key]


def test_racing_creators_and_swappers_exactly_one_wins(store_target):
    key, racers = f"{RUN}/state.json", 4
    stores = [ArtifactStore(store_target.root_uri) for _ in range(racers)]
    for store in stores:
        store.read_versioned(key)  # connect before the race
    for trial in range(3):
        start = threading.Barrier(racers, timeout=20)

        def race(call) -> list:
            results = [None] * racers

            def one(index: int) -> None:
                start.wait()
                results[index] = call(stores[index], index)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(racers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            return results

        created = race(lambda store, i: store.create_if_absent(key, f"c{trial}-{i}".encode()))
        assert sum(v is not None for v in created) == 1, created
        data, version = stores[0].read_versioned(key)
        winner = next(v for v in created if v is not None)
        assert version == winner
        swapped = race(lambda store, i: store.replace_if(key, f"s{trial}-{i}".encode(), version))
        assert sum(v is not None for v in swapped) == 1, swapped
        assert stores[0].delete_if(key, next(v for v in swapped if v is not None))


def test_diffusers_model_directory_round_trip(store_target, tmp_path):
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1, norm_num_groups=4,
    )
    model.save_pretrained(tmp_path / "saved")
    store = ArtifactStore(store_target.root_uri)

    ref = store.put_dir(store.checkpoint_key(RUN, 100), tmp_path / "saved")
    restored_dir = store.get_dir(ref, tmp_path / "restored")

    assert tree_bytes(restored_dir) == tree_bytes(tmp_path / "saved")
    restored = UNet2DModel.from_pretrained(restored_dir).state_dict()
    original = model.state_dict()
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name


def test_get_dir_needs_an_absent_or_empty_destination(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    ref = store.put_dir(f"{RUN}/model", make_source_dir(tmp_path / "src", {"a": 3, "b/c": 4}))
    (tmp_path / "empty").mkdir()
    assert tree_bytes(store.get_dir(ref, tmp_path / "empty")) == tree_bytes(tmp_path / "src")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        store.get_dir(ref, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


def test_put_dir_refuses_what_it_cannot_store_faithfully(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))  # a bare path is a file:// root
    assert store.root_uri == f"file://{tmp_path / 'store'}"
    bad_name = make_source_dir(tmp_path / "bad", {".hidden": 1})
    reserved = make_source_dir(tmp_path / "reserved", {"MANIFEST.json": 1})
    linked = make_source_dir(tmp_path / "linked", {"a": 1})
    (linked / "alias").symlink_to(bad_name, target_is_directory=True)
    for source in (bad_name, reserved, linked):
        with pytest.raises(ValueError):
            store.put_dir(f"{RUN}/model", source)
    assert store.list_checkpoints(RUN) == [] and not (tmp_path / "store").exists()


# -- atomicity -----------------------------------------------------------------------------------


def test_put_dir_interrupted_by_exception_leaves_nothing_visible(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    first = make_source_dir(tmp_path / "a", {"w": 10})
    previous = store.put_dir(store.checkpoint_key(RUN, 100), first)
    source = make_source_dir(tmp_path / "b", {"w1": 3000, "w2": 3000, "sub/w3": 3000})

    def fail_after_first_file(rel_path: str, nbytes: int) -> None:
        raise RuntimeError("writer interrupted")

    with pytest.raises(RuntimeError, match="writer interrupted"):
        store.put_dir(store.checkpoint_key(RUN, 200), source, on_file=fail_after_first_file)

    assert store.list_checkpoints(RUN) == [100]
    assert store.latest_checkpoint(RUN).ref == previous
    # The partial write was cleaned up, not merely hidden.
    assert not [k for k in store_target.raw_keys() if "200" in k]
    with pytest.raises(FileNotFoundError):
        store.checkpoint_ref(RUN, 200)


def test_failed_tensor_put_leaves_nothing(store_target):
    store = ArtifactStore(store_target.root_uri)
    shared = torch.zeros(4)
    with pytest.raises(Exception):  # safetensors refuses tensors that share memory
        store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), {"a": shared, "b": shared[:2]})
    assert store_target.raw_keys() == []


WRITER_CHILD = """
import sys, time
from infra.store import ArtifactStore

root_uri, source, marker = sys.argv[1:4]

def stall_after_first_file(rel_path, nbytes):
    open(marker, "w").close()  # tell the parent a file has landed, then wait to be killed
    time.sleep(600)

store = ArtifactStore(root_uri)
store.put_dir(store.checkpoint_key("run-1", 200), source, on_file=stall_after_first_file)
"""


def test_writer_killed_mid_write_leaves_nothing_visible(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    first = make_source_dir(tmp_path / "a", {"w": 10})
    previous = store.put_dir(store.checkpoint_key(RUN, 100), first)
    names = ("optim.safetensors", "shard-0.safetensors", "shard-1.safetensors")
    source = make_source_dir(tmp_path / "big", {name: 4 << 20 for name in names})
    marker = tmp_path / "first-file-landed"

    child = subprocess.Popen(
        [sys.executable, "-c", WRITER_CHILD, store_target.root_uri, str(source), str(marker)],
        cwd=REPO_ROOT, env=dict(os.environ),
    )
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, 60, "the first file")
        assert child.poll() is None, "the writer exited before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    # The kill came mid-write: a file landed (staged or uploaded), but no manifest.
    leftovers = [k for k in store_target.raw_keys() if "200" in k]
    assert any(k.endswith("optim.safetensors") for k in leftovers), leftovers
    assert not any(k.endswith("MANIFEST.json") for k in leftovers)
    assert store.list_checkpoints(RUN) == [100]
    assert store.latest_checkpoint(RUN).ref == previous
    with pytest.raises(FileNotFoundError):
        store.checkpoint_ref(RUN, 200)

    # Writing the same step again recovers: the leftovers never mix into the new directory.
    ref = store.put_dir(store.checkpoint_key(RUN, 200), source)
    assert store.latest_checkpoint(RUN).step == 200
    assert tree_bytes(store.get_dir(ref, tmp_path / "out")) == tree_bytes(source)


def test_latest_checkpoint_ignores_folders_without_manifest(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    ref = store.put_dir(store.checkpoint_key(RUN, 5), make_source_dir(tmp_path / "a", {"w": 1}))
    # A stray file at a newer step (what a crashed non-atomic writer would leave behind).
    store.put_json(f"{RUN}/checkpoints/9/w", [1])
    assert store.list_checkpoints(RUN) == [5]
    assert store.latest_checkpoint(RUN).ref == ref
    assert store.latest_checkpoint("other-run") is None


def test_put_dir_is_idempotent_but_never_replaces_different_contents(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    key = store.checkpoint_key(RUN, 7)
    ref = store.put_dir(key, make_source_dir(tmp_path / "a", {"w": 100}, seed=1))
    assert store.put_dir(key, tmp_path / "a") == ref  # a retried task succeeds
    with pytest.raises(ArtifactExistsError):
        store.put_dir(key, make_source_dir(tmp_path / "b", {"w": 100}, seed=2))
    assert store.checkpoint_ref(RUN, 7) == ref


# -- integrity -----------------------------------------------------------------------------------


def test_flipped_byte_in_tensors_is_detected(store_target):
    store = ArtifactStore(store_target.root_uri)
    key = store.rollout_key(RUN, 0, "score", 0)
    ref = store.put_tensors(key, sample_tensors())
    store_target.flip_byte(key, ref.nbytes - 3)  # inside the tensor data, not the header

    with pytest.raises(IntegrityError) as info:
        store.get_tensors(ref)
    assert info.value.uri == ref.uri and info.value.expected_sha256 == ref.sha256
    message = str(info.value)
    assert ref.uri in message and ref.sha256 in message and info.value.actual_sha256 in message
    assert info.value.actual_sha256 != ref.sha256


def test_flipped_byte_in_tensor_header_is_an_integrity_error(store_target):
    """The header is parsed only once the digest matched: corrupt bytes never reach the parser."""
    store = ArtifactStore(store_target.root_uri)
    key = store.rollout_key(RUN, 0, "score", 0)
    ref = store.put_tensors(key, sample_tensors())
    store_target.flip_byte(key, 8)  # the header's opening '{'

    with pytest.raises(IntegrityError) as info:
        store.get_tensors(ref)
    assert info.value.expected_sha256 == ref.sha256 != info.value.actual_sha256


def test_a_flipped_byte_is_detected_in_any_piece(store_target):
    """Damage in the first, a middle or the last MiB of an object fails the read."""
    store = ArtifactStore(store_target.root_uri)
    tensors = {"a": torch.randn(800_000), "b": torch.randn(3_333, dtype=torch.float64)}
    key = store.rollout_key(RUN, 0, "score", 0)
    ref = store.put_tensors(key, tensors)
    assert ref.nbytes > 3 * PIECE
    assert_bitwise_equal(tensors, store.get_tensors(ref))
    for offset in (100, PIECE + 7, ref.nbytes - 1):
        store_target.flip_byte(key, offset)
        with pytest.raises(IntegrityError):
            store.get_tensors(ref)
        store_target.flip_byte(key, offset)  # flipped back: the object reads again
        assert_bitwise_equal(tensors, store.get_tensors(ref))


def test_loaded_tensors_are_private_copies_of_the_verified_bytes(tmp_path):
    """Tensors come from the bytes that were hashed, not from a mapping of the file: changing
    the file in place afterwards does not reach them."""
    store = ArtifactStore(f"file://{tmp_path}")
    tensors = {"a": torch.randn(1000)}
    key = store.rollout_key(RUN, 0, "score", 0)
    ref = store.put_tensors(key, tensors)
    loaded = store.get_tensors(ref)
    path = tmp_path / key
    path.write_bytes(path.read_bytes()[:-4000] + bytes(4000))
    assert_bitwise_equal(tensors, loaded)


def test_directory_files_of_every_size_copy_in_blocks(store_target, tmp_path, monkeypatch):
    """Files are copied block by block (ranged GETs on S3), hashed as they pass: empty, one byte, and many
    blocks with a ragged end all arrive whole, with the reference digest in the manifest; a flipped byte in
    a middle block is caught."""
    monkeypatch.setattr(store_io, "BLOCK_BYTES", 2 * PIECE)
    store = ArtifactStore(store_target.root_uri)
    sizes = {"empty": 0, "one": 1, "model/weights.bin": 5 * PIECE + 3}
    source = make_source_dir(tmp_path / "src", sizes)
    key = store.checkpoint_key(RUN, 3)
    ref = store.put_dir(key, source)
    manifest = json.loads(store_target.read_raw(f"{key}/MANIFEST.json"))
    expected = tree_bytes(source)
    assert {e["path"]: e["sha256"] for e in manifest["files"]} == {
        path: reference_digest(data) for path, data in expected.items()
    }
    assert tree_bytes(store.get_dir(ref, tmp_path / "out")) == expected
    store_target.flip_byte(f"{key}/model/weights.bin", 3 * PIECE + 1)
    with pytest.raises(IntegrityError, match="weights.bin"):
        store.get_dir(ref, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_flipped_byte_in_directory_is_detected(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    key = store.checkpoint_key(RUN, 1)
    ref = store.put_dir(key, make_source_dir(tmp_path / "src", {"a.bin": 5000, "sub/b.bin": 5000}))
    store_target.flip_byte(f"{key}/sub/b.bin", 1234)

    with pytest.raises(IntegrityError) as info:
        store.get_dir(ref, tmp_path / "out")
    assert info.value.uri == f"{ref.uri}/sub/b.bin"
    assert not (tmp_path / "out").exists()  # no partial or unverified copy is left behind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_flipped_byte_in_manifest_is_detected(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    key = store.checkpoint_key(RUN, 1)
    ref = store.put_dir(key, make_source_dir(tmp_path / "src", {"a.bin": 10}))
    store_target.flip_byte(f"{key}/MANIFEST.json", 20)
    with pytest.raises(IntegrityError, match="manifest"):
        store.get_dir(ref, tmp_path / "out")


# -- safety of names and refs ------------------------------------------------------------------


BAD_NAMES = [
    "../escape", "..", ".", "/abs", "/etc/passwd", "s3://other-bucket/x", "file:///etc",
    "a/b", "", "a b", "bad\x00", ".hidden", "-rf", "x\\y", "a:b",
]


@pytest.mark.parametrize("run_id", BAD_NAMES)
def test_unsafe_run_ids_are_refused(store_target, run_id):
    store = ArtifactStore(store_target.root_uri)
    with pytest.raises(ValueError):
        store.rollout_key(run_id, 0, "actor", 0)
    with pytest.raises(ValueError):
        store.checkpoint_key(run_id, 0)
    with pytest.raises(ValueError):
        store.latest_checkpoint(run_id)
    with pytest.raises(ValueError):
        store.prune(run_id, keep_last=1)


@pytest.mark.parametrize("key", ["../x", "a/../b", "/a", "a//b", "a/", "s3://b/k", "a/./b"])
def test_unsafe_keys_are_refused(tmp_path, key):
    store = ArtifactStore(f"file://{tmp_path}")
    with pytest.raises(ValueError):
        store.put_json(key, 1)
    assert list(tmp_path.iterdir()) == []


def test_bad_indices_are_refused():
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError):
            ArtifactStore.rollout_key(RUN, bad, "actor", 0)
        with pytest.raises(ValueError):
            ArtifactStore.checkpoint_key(RUN, bad)


def test_refs_outside_the_root_are_refused(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    ref = store.put_json(f"{RUN}/x.json", [1])
    other = ArtifactStore(f"file://{tmp_path}/other")
    escapes = [
        ArtifactRef(f"{store.root_uri}/../x.json", ref.sha256, 1, "json"),
        ArtifactRef(f"{store.root_uri}x/{RUN}/x.json", ref.sha256, 1, "json"),
        ArtifactRef("file:///etc/passwd", ref.sha256, 1, "json"),
    ]
    for bad in escapes:
        with pytest.raises(ValueError):
            store.get_json(bad)
    with pytest.raises(ValueError, match="not under"):
        other.get_json(ref)
    with pytest.raises(ValueError, match="not 'tensors'"):
        store.get_tensors(ref)


@pytest.mark.parametrize("root", ["http://x.org/a", "gs://bucket", "s3://key:secret@bucket/x"])
def test_unsupported_or_credentialed_roots_are_refused(root):
    with pytest.raises(ValueError) as info:
        ArtifactStore(root)
    assert "secret" not in str(info.value)


def test_store_pickles_without_state(store_target):
    store = ArtifactStore(store_target.root_uri, retry_mode="adaptive", max_attempts=3)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.root_uri == store.root_uri
    assert (clone.retry_mode, clone.max_attempts) == ("adaptive", 3)


# -- retention -----------------------------------------------------------------------------------


def test_prune_keeps_last_rollouts_and_all_checkpoints(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    tensors = {"x": torch.ones(2)}
    for rollout in range(6):
        for rank in range(2):
            store.put_tensors(store.rollout_key(RUN, rollout, "actor", rank), tensors)
    checkpoints = {}
    for step in (2, 4):
        source = make_source_dir(tmp_path / f"c{step}", {"w": 8})
        checkpoints[step] = store.put_dir(store.checkpoint_key(RUN, step), source)

    assert store.prune(RUN, keep_last=2) == [0, 1, 2, 3]
    assert store.list_rollouts(RUN) == [4, 5]
    assert store.get_tensors(store.put_tensors(store.rollout_key(RUN, 5, "actor", 0), tensors))
    assert store.list_checkpoints(RUN) == [2, 4]
    for step, ref in checkpoints.items():
        assert store.checkpoint_ref(RUN, step) == ref
        store.get_dir(ref, tmp_path / f"out{step}")
    assert store.prune(RUN, keep_last=2) == []
    assert store.prune(RUN, keep_last=0) == [4, 5] and store.list_rollouts(RUN) == []
    assert store.list_checkpoints(RUN) == [2, 4]
    with pytest.raises(ValueError):
        store.prune(RUN, keep_last=-1)


def _age(path: Path, seconds: float) -> None:
    """Set the modification time of ``path`` and everything below it ``seconds`` in the past."""
    stamp = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (stamp, stamp))


def test_prune_deletes_what_killed_writers_left_and_nothing_live(tmp_path):
    """A checkpoint cut short by a kill leaves a hidden staging folder; prune removes it once it
    has not changed for an hour, and leaves a live writer's staging (something changed lately)."""
    store = ArtifactStore(f"file://{tmp_path}")
    done = store.put_dir(store.checkpoint_key(RUN, 2), make_source_dir(tmp_path / "c", {"w": 8}))
    run_dir = tmp_path / RUN
    dead_dir = Path(hidden_sibling(str(run_dir / "checkpoints" / "4"), "partial"))
    (dead_dir / "sub").mkdir(parents=True)
    (dead_dir / "sub" / "w.safetensors").write_bytes(bytes(1000))
    dead_file = Path(hidden_sibling(str(run_dir / "eval" / "student.safetensors"), "tmp"))
    dead_file.parent.mkdir()
    dead_file.write_bytes(bytes(10))
    live_dir = Path(hidden_sibling(str(run_dir / "checkpoints" / "6"), "partial"))
    live_dir.mkdir()
    (live_dir / "old.safetensors").write_bytes(bytes(10))
    (live_dir / "new.safetensors").write_bytes(bytes(10))
    for path in (dead_dir, dead_file, live_dir):
        _age(path, STALE_STAGING_S + 60)
    os.utime(live_dir / "new.safetensors")  # its writer is still at work

    assert store.prune(RUN, keep_last=0) == []
    assert not dead_dir.exists() and not dead_file.exists()
    assert (live_dir / "new.safetensors").exists()
    assert store.list_checkpoints(RUN) == [2] and store.checkpoint_ref(RUN, 2) == done
    store.get_dir(done, tmp_path / "out")


# -- S3 faults -----------------------------------------------------------------------------------


def test_put_is_retried_while_s3_restarts(s3_target, moto_server, caplog):
    store = ArtifactStore(s3_target.root_uri)  # the default retries (botocore's) must ride this out
    before = store.put_json(f"{RUN}/before.json", 1)
    tensors = sample_tensors()

    moto_server.stop()
    restarter = moto_server.start_after(2.0)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="botocore.retries"):
        ref = store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), tensors)
    elapsed = time.monotonic() - started
    restarter.join(timeout=30)

    assert elapsed > 1.5, "the put cannot have succeeded while the server was down"
    assert RETRY_LOG in caplog.text
    assert_bitwise_equal(tensors, store.get_tensors(ref))
    # moto's state lives in-process: the bucket and earlier objects survived the restart.
    assert store.get_json(before) == 1


def test_unreachable_endpoint_gives_up_after_bounded_retries(s3_target, monkeypatch, caplog):
    """botocore alone retries: 3 attempts are 2 retries, not multiplied by a retry loop of s3fs's or ours."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    store = ArtifactStore(s3_target.root_uri, max_attempts=3)
    with caplog.at_level(logging.DEBUG, logger="botocore.retries"), pytest.raises(StoreUnavailableError) as info:
        store.put_json(f"{RUN}/x.json", 1)
    assert "3 attempts" in str(info.value) and "AWS_ENDPOINT_URL" in str(info.value)
    assert caplog.text.count(RETRY_LOG) == 2


def test_service_specific_endpoint_variable_is_honoured(s3_target, moto_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint)  # botocore: S3-specific wins
    store = ArtifactStore(s3_target.root_uri, max_attempts=1)
    assert store.get_json(store.put_json(f"{RUN}/x.json", {"a": 1})) == {"a": 1}


def test_wrong_credentials_fail_at_once_without_leaking_the_secret(
    s3_target, moto_server, monkeypatch, caplog
):
    secret = f"wr0ng-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY00000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    moto_server.require_credentials(True)
    caplog.set_level(logging.DEBUG)
    store = ArtifactStore(s3_target.root_uri)

    with pytest.raises(StoreAccessError) as put_error:
        store.put_tensors(store.rollout_key(RUN, 0, "actor", 0), {"x": torch.ones(1)})
    with pytest.raises(StoreAccessError) as list_error:
        store.latest_checkpoint(RUN)
    assert RETRY_LOG not in caplog.text, "refused credentials must not be retried"

    for error in (put_error.value, list_error.value):
        message = str(error)
        assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
        assert "AWS_PROFILE" in message
        assert secret not in "".join(traceback.format_exception(error))
    assert caplog.records, "DEBUG logging was on, so botocore/s3fs must have logged something"
    assert secret not in caplog.text
    assert secret not in repr(store) and secret not in str(pickle.dumps(store))


def test_missing_bucket_fails_at_once(s3_env, caplog):
    store = ArtifactStore("s3://no-such-bucket/artifacts")
    with caplog.at_level(logging.DEBUG, logger="botocore.retries"):
        with pytest.raises(StoreNotFoundError) as info:
            store.put_json(f"{RUN}/x.json", 1)
        with pytest.raises(StoreNotFoundError):
            store.latest_checkpoint(RUN)  # a missing bucket is not "no checkpoint yet"
    assert RETRY_LOG not in caplog.text, "a missing bucket must not be retried"
    assert "no-such-bucket" in str(info.value) and "AWS_ENDPOINT_URL" in str(info.value)


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "PutObject")


@pytest.mark.parametrize(
    "error, translated",
    [
        (_client_error("SlowDown", 503), StoreUnavailableError),
        (_client_error("InternalError", 500), StoreUnavailableError),
        (_client_error("Throttling", 400), StoreUnavailableError),
        (_client_error("Whatever", 502), StoreUnavailableError),
        (_client_error("InvalidAccessKeyId", 403), StoreAccessError),
        (_client_error("SignatureDoesNotMatch", 403), StoreAccessError),
        (_client_error("AccessDenied", 403), StoreAccessError),
        (_client_error("403", 403), StoreAccessError),
        (_client_error("NoSuchBucket", 404), StoreNotFoundError),
        (_client_error("NoSuchKey", 404), None),
        (ConnectionRefusedError(111, "refused"), StoreUnavailableError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), StoreUnavailableError),
        (botocore.exceptions.NoCredentialsError(), StoreAccessError),
        (ValueError("bug"), None),
    ],
)
def test_what_still_fails_after_the_retries_is_translated(error, translated):
    """What S3 still raises after botocore's last attempt, as the store error to act on (None: it propagates
    as it is), also once s3fs has wrapped it in an OSError."""
    wrapped = OSError("translated by s3fs")
    wrapped.__cause__ = error
    for raised in (error, wrapped):
        found = s3_error(raised, "s3://b/k", "b", "http://127.0.0.1:1", attempts=8)
        assert type(found) is translated if translated else found is None


def test_a_put_leaves_its_tensors_resizable(tmp_path):
    """A trainer group's sleep resizes parameter storages in place; storing them must not pin them."""
    store = ArtifactStore(tmp_path.as_uri())
    weight = torch.randn(4, 3)
    ref = store.put_tensors(f"{RUN}/w.safetensors", {"w": weight})
    weight.untyped_storage().resize_(0)  # raises if the put exported the storage (e.g. via .numpy())
    assert store.get_tensors(ref)["w"].shape == (4, 3)

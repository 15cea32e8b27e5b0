"""Tests of ArtifactStore.resume_checkpoint and quarantine_checkpoint (infra/store/artifacts.py): a damaged
checkpoint is moved aside, kept and reported, and the one before is loaded; a fault of the moment (the S3
endpoint down, a torn read) condemns nothing. On file:// and on a real S3 API (moto's server)."""

from __future__ import annotations

import itertools
import time

import pytest

from infra.store import ArtifactStore, IntegrityError, StoreUnavailableError
from tests.infra.store.test_artifacts import make_source_dir, tree_bytes

RUN = "run-1"


def three_checkpoints(store: ArtifactStore, tmp_path) -> dict[str, dict[str, bytes]]:
    """Steps 1 and 2, each an actor directory with rank 1's part and a critic directory, as the trainer groups
    write them (infra/trainers/checkpoint.py); returns each stored folder's files by key."""
    written = {}
    for step, (folder, suffix) in itertools.product((1, 2), [("checkpoints", ""), ("checkpoints", "-rank-1"),
                                                              ("checkpoints_critic", "")]):
        key = f"{RUN}/{folder}/{step}{suffix}"
        source = make_source_dir(tmp_path / "src" / key, {"__0_0.distcp": 3000, "sub/info.json": 10}, seed=step)
        store.put_dir(key, source)
        written[key] = tree_bytes(source)
    return written


class Loads:
    """A `load` for resume_checkpoint that reads the whole checkpoint, as the trainer groups do, and counts."""

    def __init__(self, store: ArtifactStore, tmp_path, before=None):
        self.store, self.tmp_path, self.before, self.calls = store, tmp_path, before, []

    def __call__(self, ref) -> None:
        self.calls.append(ref.uri.rsplit("/", 1)[-1])
        if self.before is not None:
            self.before(len(self.calls))
        self.store.get_dir(ref, self.tmp_path / f"loaded-{len(self.calls)}")


def test_a_damaged_checkpoint_is_quarantined_and_the_one_before_loaded(store_target, tmp_path):
    store = ArtifactStore(store_target.root_uri)
    written = three_checkpoints(store, tmp_path)
    store_target.flip_byte(f"{RUN}/checkpoints/2/__0_0.distcp", 1234)
    damaged = store_target.read_raw(f"{RUN}/checkpoints/2/__0_0.distcp")
    reports = []
    load = Loads(store, tmp_path)

    assert store.resume_checkpoint(RUN, load, on_damaged=lambda *report: reports.append(report)) == 1
    assert load.calls == ["2", "2", "1"]  # read once more before it was condemned
    [(step, error, where)] = reports
    assert step == 2 and isinstance(error, IntegrityError) and error.uri.endswith("checkpoints/2/__0_0.distcp")
    assert where.startswith(f"{store.root_uri}/{RUN}/quarantine/2-")
    assert store.list_checkpoints(RUN) == [1] and store.latest_checkpoint(RUN).step == 1

    # Kept, every part of it, byte for byte as it was found; the checkpoint before is untouched.
    moved = where.removeprefix(store.root_uri + "/")
    kept = {key: store_target.read_raw(key) for key in store_target.raw_keys() if key.startswith(moved + "/")}
    for key in (f"{RUN}/checkpoints/2", f"{RUN}/checkpoints/2-rank-1", f"{RUN}/checkpoints_critic/2"):
        folder = key.removeprefix(f"{RUN}/")
        files = dict(written[key])
        if folder == "checkpoints/2":
            files["__0_0.distcp"] = damaged
        assert {path: kept[f"{moved}/{folder}/{path}"] for path in files} == files, key
        assert f"{moved}/{folder}/MANIFEST.json" in kept
        assert not [k for k in store_target.raw_keys() if k.startswith(key + "/")], key
    assert tree_bytes(store.get_dir(store.checkpoint_ref(RUN, 1), tmp_path / "one")) == written[f"{RUN}/checkpoints/1"]
    assert store.prune(RUN, keep_last=0) == [] and kept.keys() <= set(store_target.raw_keys())


def test_a_torn_read_is_read_again_before_anything_is_condemned(tmp_path):
    """The first read finds a byte wrong, the second finds it right (a read that raced a repair, a flaky
    disk): the checkpoint loads and stays where it is."""
    store = ArtifactStore((tmp_path / "store").as_uri())
    three_checkpoints(store, tmp_path)
    shard = tmp_path / "store" / RUN / "checkpoints" / "2" / "__0_0.distcp"

    def flip(call: int) -> None:
        if call <= 2:  # damaged for the first read, whole again for the second
            data = bytearray(shard.read_bytes())
            data[99] ^= 1
            shard.write_bytes(data)

    load = Loads(store, tmp_path, before=flip)
    assert store.resume_checkpoint(RUN, load) == 2
    assert load.calls == ["2", "2"]
    assert store.list_checkpoints(RUN) == [1, 2] and not (tmp_path / "store" / RUN / "quarantine").exists()


def test_a_checkpoint_read_while_s3_restarts_is_loaded(s3_target, moto_server, tmp_path):
    """The endpoint goes down as the checkpoint is read and is back 2 s later: botocore's retries ride it out;
    nothing is condemned."""
    store = ArtifactStore(s3_target.root_uri)
    written = three_checkpoints(store, tmp_path)
    restarted = []

    def outage(call: int) -> None:
        if call == 1:
            moto_server.stop()
            restarted.append(moto_server.start_after(2.0))

    load, started = Loads(store, tmp_path, before=outage), time.monotonic()
    assert store.resume_checkpoint(RUN, load) == 2
    restarted[0].join(timeout=30)
    assert time.monotonic() - started > 1.5 and load.calls == ["2"]
    assert tree_bytes(tmp_path / "loaded-1") == written[f"{RUN}/checkpoints/2"]
    assert store.list_checkpoints(RUN) == [1, 2]
    assert not [key for key in s3_target.raw_keys() if "quarantine" in key]


def test_a_store_that_stays_down_fails_the_resume_and_condemns_nothing(s3_target, moto_server, tmp_path):
    store = ArtifactStore(s3_target.root_uri, max_attempts=3)
    three_checkpoints(store, tmp_path)
    load = Loads(store, tmp_path, before=lambda call: moto_server.stop())
    try:
        with pytest.raises(StoreUnavailableError, match="3 attempts"):
            store.resume_checkpoint(RUN, load)
    finally:
        moto_server.start()
    assert load.calls == ["2"]
    assert store.list_checkpoints(RUN) == [1, 2]
    assert not [key for key in s3_target.raw_keys() if "quarantine" in key]

"""Faults of the artifact store during a run, injected for real: the S3 endpoint down for seconds (moto's
server stopped and started again), stored bytes flipped on disk (a rollout artifact in use, the latest
checkpoint), and a filesystem that is full or read-only. Each run either ends with the uninterrupted run's
student, bit for bit, or fails with a clear error having left nothing half-written."""

import logging
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import boto3
import pytest
import torch

from flows.distill import distill
from infra.store import ArtifactStore, StoreWriteError
from infra.store.io import is_staging_name
from infra.store.keys import MANIFEST_NAME
from tests.flows.conftest import TINY_EVAL_INTERVAL, TINY_ROLLOUTS, write_recipe
from tests.infra.conftest import BUCKET, REGION
from tests.reliability.checks import assert_every_step_once, assert_same_student
from tests.reliability.faults import flip_byte, when
from tests.tracking_db import tracking_uri_in

ROLLOUTS = TINY_ROLLOUTS
pytestmark = pytest.mark.usefixtures("shared_ray")  # the runs join the session's Ray


@pytest.fixture(scope="module")
def uninterrupted(tiny_run) -> dict:
    """The tiny recipe's run with nothing going wrong: what every faulty run must equal."""
    return tiny_run[0]


def _common(tmp_path: Path, teacher: Path, cache: Path, rollouts: int = ROLLOUTS) -> dict:
    recipe = write_recipe(tmp_path / f"tiny-{rollouts}.toml", teacher, rollouts, eval_interval=TINY_EVAL_INTERVAL)
    return dict(recipe=str(recipe), tracking_uri=tracking_uri_in(tmp_path),
                cache_dir=str(cache), output_dir=str(tmp_path / "out"))


def _s3_keys(prefix: str) -> list[str]:
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    return [item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


@pytest.mark.slow
def test_the_s3_endpoint_down_for_seconds_mid_run_is_ridden_out(s3_server, s3_store, uninterrupted,
                                                                tiny_teacher_dir, shared_cache, tmp_path):
    def outage():
        s3_server.stop()
        time.sleep(3.0)
        s3_server.start()
        return True

    down = when(lambda: bool(_s3_keys("runs/outage/rollout-1/")), outage)
    common = _common(tmp_path, tiny_teacher_dir, shared_cache)
    result = distill(**common, run_id="outage", store_uri=s3_store)
    down.join(timeout=30)
    assert down.fired and down.result
    assert_same_student(result, uninterrupted)
    assert_every_step_once(common["tracking_uri"], result, ROLLOUTS)


class _Warnings(logging.Handler):
    """The messages of every warning logged, as caplog keeps them, for a fixture wider than one test."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def damaged_store_run(uninterrupted, tiny_teacher_dir, shared_cache, tmp_path_factory) -> dict:
    """Two faults of a file store that never meet, in one run: its latest checkpoint (after 2 rollouts) flipped
    on disk before the run goes on to 4, then its train pairs of rollout 3 flipped as soon as convert wrote them.
    The run ends with the uninterrupted student, every step logged once."""
    tmp = tmp_path_factory.mktemp("damaged")
    root = tmp / "store"
    distill(**_common(tmp, tiny_teacher_dir, shared_cache, rollouts=2), run_id="damaged", store_uri=root.as_uri())
    shard = next((root / "damaged" / "checkpoints" / "2").glob("*.distcp"))
    flip_byte(shard)
    damaged_shard = shard.read_bytes()
    pairs, written = root / "damaged" / "rollout-3" / "convert" / "rank-0.safetensors", {}

    def corrupt_pairs():
        written["pairs"] = pairs.read_bytes()
        flip_byte(pairs)
        return True

    flipper = when(pairs.is_file, corrupt_pairs)
    more, warnings = _common(tmp, tiny_teacher_dir, shared_cache, rollouts=ROLLOUTS), _Warnings()
    logging.getLogger().addHandler(warnings)
    try:
        continued = distill(**more, run_id="damaged", store_uri=root.as_uri())
    finally:
        logging.getLogger().removeHandler(warnings)
    assert_same_student(continued, uninterrupted)
    assert_every_step_once(more["tracking_uri"], continued, ROLLOUTS)
    return dict(root=root, shard=shard, damaged_shard=damaged_shard,
                pairs=pairs, pairs_flipped=flipper.fired, pairs_written=written.get("pairs"),
                warnings=warnings.messages)


@pytest.mark.slow
def test_a_corrupted_rollout_artifact_is_made_again_by_its_task(damaged_store_run):
    """The train pairs' reader finds their checksum wrong, convert runs again, and the run goes on to the
    uninterrupted student."""
    assert damaged_store_run["pairs_flipped"]
    pairs = damaged_store_run["pairs"]
    if pairs.exists():  # kept (keep_rollouts = 2): made again, byte for byte what convert first wrote
        assert pairs.read_bytes() == damaged_store_run["pairs_written"]


@pytest.mark.slow
def test_a_corrupted_latest_checkpoint_is_quarantined_and_the_one_before_used(damaged_store_run):
    root, shard = damaged_store_run["root"], damaged_store_run["shard"]
    store = ArtifactStore(root.as_uri())
    assert store.list_checkpoints("damaged") == list(range(1, ROLLOUTS + 1))  # 2 written again, from the replay
    assert any("the checkpoint after 2 rollouts is damaged" in message and "quarantine" in message
               for message in damaged_store_run["warnings"])
    # Moved aside and kept as it was found, not deleted: the actor's and the critic's directories of step 2.
    [kept] = (root / "damaged" / "quarantine").iterdir()
    assert kept.name.startswith("2-") and (kept / "checkpoints" / "2" / shard.name).read_bytes() == \
        damaged_store_run["damaged_shard"]
    assert (kept / "checkpoints" / "2" / MANIFEST_NAME).is_file()
    assert (kept / "checkpoints_critic" / "2" / MANIFEST_NAME).is_file()


@contextmanager
def _tmpfs(path: Path, size: str):
    """A small tmpfs mounted at `path` (root and CAP_SYS_ADMIN; skips the test elsewhere)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(folder: Path) -> None:
    """Write until the filesystem has no byte left (unbuffered: closing must not fail on what is left)."""
    with open(folder / "ballast", "wb", buffering=0) as ballast:
        try:
            while True:
                ballast.write(b"\0" * (1 << 16))
        except OSError:
            pass


def _staging_left(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if is_staging_name(path.name)]


@pytest.mark.slow
def test_a_full_store_fails_the_run_clearly_and_leaves_no_partial_checkpoint(prefect_server, tiny_teacher_dir,
                                                                             shared_cache, tmp_path):
    with _tmpfs(tmp_path / "disk", "64m") as disk:
        store_root = disk / "store"
        first_checkpoint = store_root / "full" / "checkpoints" / "1" / MANIFEST_NAME
        filler = when(first_checkpoint.is_file, lambda: _fill(disk))
        with pytest.raises(StoreWriteError) as failure:
            distill(**_common(tmp_path, tiny_teacher_dir, shared_cache, rollouts=6), run_id="full",
                    store_uri=store_root.as_uri())
        filler.join(timeout=60)
        assert filler.fired, "the store never held its first checkpoint"
        message = str(failure.value)
        assert "no space left" in message and str(store_root) in message and "--store" in message
        (disk / "ballast").unlink()
        store = ArtifactStore(store_root.as_uri())
        latest = store.latest_checkpoint("full")
        assert latest is not None and latest.step >= 1
        store.get_dir(latest.ref, tmp_path / "latest")  # complete: every file there and verified
        assert _staging_left(store_root) == []
        assert not (store_root / "full" / "student").exists()


def test_a_read_only_store_refuses_writes_clearly(tmp_path):
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        store = ArtifactStore((disk / "store").as_uri())
        store.put_tensors("run/a.safetensors", {"x": torch.ones(3)})
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for write in (lambda: store.put_tensors("run/b.safetensors", {"x": torch.ones(3)}),
                      lambda: store.put_json("run/c.json", {"a": 1}),
                      lambda: store.put_dir("run/d", tmp_path)):
            with pytest.raises(StoreWriteError, match=r"read-only.*--store"):
                write()
        assert sorted(p.name for p in (disk / "store" / "run").iterdir()) == ["a.safetensors"]

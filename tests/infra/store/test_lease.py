"""Tests of infra/store/lease.py: the run lease on file:// and on a real S3 API (moto's server).

Nothing is mocked: leases race through real flock'd files and real conditional PUTs over HTTP,
holders are real threads and real processes, stopped and killed with real signals. Every lease
here has a ttl of a second or less, so expiry is waited for, never faked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from infra.store import ArtifactStore, LeaseHeldError, LeaseLostError, RunLease, StoreError
from infra.store.lease import LeaseRecord

REPO_ROOT = Path(__file__).resolve().parents[3]
RUN = "run-1"
LEASE = f"{RUN}/lease.json"


def stored_lease(store: ArtifactStore) -> LeaseRecord | None:
    stored = store.read_versioned(LEASE)
    return None if stored is None else LeaseRecord.decode(stored[0], store.uri(LEASE))


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
    return result


def expire(lease: RunLease) -> None:
    """Sleep until the stored lease's expiry has passed (its renewal must be stopped)."""
    time.sleep(max(0.0, lease.expires_at - time.time()) + 0.05)


# -- acquire, hold, release ----------------------------------------------------------------------


def test_acquire_stores_the_lease_and_release_deletes_it(store_target):
    store = ArtifactStore(store_target.root_uri)
    with RunLease.acquire(store, RUN, "host-a pid 1, flow run f-1", ttl_s=30) as lease:
        document = json.loads(store_target.read_raw(LEASE))
        assert document["holder"] == "host-a pid 1, flow run f-1"
        assert document["token"] == lease.token and len(lease.token) == 32
        assert 29 < document["expires_at"] - document["renewed_at"] <= 30
        assert abs(document["renewed_at"] - time.time()) < 5
        lease.check()
    assert stored_lease(store) is None
    assert [k for k in store_target.raw_keys() if not k.startswith(f"{RUN}/.")] == []
    RunLease.acquire(store, RUN, "host-a pid 2", ttl_s=30).release()  # free again


def test_a_held_run_id_is_refused_at_once_naming_its_holder(store_target):
    store = ArtifactStore(store_target.root_uri)
    other = ArtifactStore(store_target.root_uri)
    other.read_versioned(LEASE)  # connect first: a new s3fs client's first call sets up a session
    with RunLease.acquire(store, RUN, "host-a pid 41, Prefect flow run 7f3c", ttl_s=30):
        started = time.monotonic()
        with pytest.raises(LeaseHeldError) as info:
            RunLease.acquire(other, RUN, "host-b pid 9")
        elapsed = time.monotonic() - started
    assert elapsed < 0.5, f"a held lease must be refused without waiting, took {elapsed:.2f} s"
    error = info.value
    message = str(error)
    assert "host-a pid 41, Prefect flow run 7f3c" in message and "another run id" in message
    assert "last renewed" in message and "expiring" in message and store.uri(LEASE) in message
    assert error.holder == "host-a pid 41, Prefect flow run 7f3c"
    assert 29 < error.expires_at - error.renewed_at <= 30
    copy = pickle.loads(pickle.dumps(error))  # Prefect may ship it across processes
    assert isinstance(copy, LeaseHeldError) and copy.holder == error.holder


def test_prune_never_deletes_the_lease(store_target):
    store = ArtifactStore(store_target.root_uri)
    with RunLease.acquire(store, RUN, "trainer", ttl_s=30) as lease:
        for rollout in range(3):
            store.put_tensors(store.rollout_key(RUN, rollout, "actor", 0), {"x": torch.ones(2)})
        assert store.prune(RUN, keep_last=0) == [0, 1, 2]
        assert store.list_rollouts(RUN) == [] and store.latest_checkpoint(RUN) is None
        assert stored_lease(store).token == lease.token
        lease.check()


# -- expiry, takeover and loss -------------------------------------------------------------------


def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it(store_target, caplog):
    store = ArtifactStore(store_target.root_uri)
    old = RunLease.acquire(store, RUN, "stalled host", ttl_s=0.5, background=False)
    expire(old)
    with caplog.at_level(logging.WARNING, logger="infra.store.lease"):
        new = RunLease.acquire(ArtifactStore(store_target.root_uri), RUN, "new host", ttl_s=30)
    assert "took over the stale lease" in caplog.text and "stalled host" in caplog.text

    with pytest.raises(LeaseLostError, match="new host") as info:
        old.renew()
    assert "ttl of 0.5 s" in str(info.value)
    with pytest.raises(LeaseLostError):
        old.check()  # the loss is remembered
    old.release()  # must not delete the new holder's lease
    assert stored_lease(store).token == new.token
    new.check()
    new.release()
    assert stored_lease(store) is None


def test_an_expired_lease_nobody_took_is_still_its_holders(store_target):
    store = ArtifactStore(store_target.root_uri)
    lease = RunLease.acquire(store, RUN, "slow host", ttl_s=0.3, background=False)
    expire(lease)
    checked_at = time.time()
    lease.check()  # expired but untouched: check renews it, and it is ours for another ttl from then
    # Read from the store, not against the clock: a slow store (moto under a loaded machine, 2 s a PUT) may let
    # the renewed 0.3 s pass again before the next line runs.
    stored = stored_lease(store)
    assert stored.token == lease.token and stored.expires_at == lease.expires_at >= checked_at + 0.3
    lease.release()


def test_racing_takers_of_one_stale_lease_exactly_one_wins(store_target):
    store = ArtifactStore(store_target.root_uri)
    takers = [ArtifactStore(store_target.root_uri) for _ in range(4)]  # a client each, as processes
    barrier = [threading.Barrier(len(takers))]
    for taker in takers:
        taker.read_versioned(LEASE)  # connected before the race (a first call sets up a session)
        # Every compare-and-swap waits until all takers have read the stale lease, so the swaps
        # race on one version (and not merely on who reads first).
        swap = taker.replace_if
        taker.replace_if = lambda *args, swap=swap: (barrier[0].wait(timeout=20), swap(*args))[1]

    for trial in range(4):
        stale = RunLease.acquire(store, RUN, "dead host", ttl_s=0.2, background=False)
        expire(stale)
        barrier[0] = threading.Barrier(len(takers))
        results: dict[int, object] = {}

        def take(index: int) -> None:
            try:
                results[index] = RunLease.acquire(takers[index], RUN, f"taker {index}", ttl_s=30,
                                                  background=False)
            except Exception as exc:
                results[index] = exc

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(takers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        winners = [r for r in results.values() if isinstance(r, RunLease)]
        losers = [r for r in results.values() if not isinstance(r, RunLease)]
        assert len(winners) == 1, f"trial {trial}: {len(winners)} winners: {results}"
        assert all(isinstance(r, LeaseHeldError) for r in losers), losers
        assert all(r.holder == winners[0].holder for r in losers)
        assert stored_lease(store).token == winners[0].token
        winners[0].release()


def test_background_renewal_keeps_the_lease_alive_past_several_ttls(store_target):
    store = ArtifactStore(store_target.root_uri)
    with RunLease.acquire(store, RUN, "busy host", ttl_s=1.0) as lease:
        first_expiry = lease.expires_at
        time.sleep(3.2)  # more than three ttls
        lease.check()
        stored = stored_lease(store)
        assert stored.token == lease.token and stored.expires_at > first_expiry + 2
        assert time.time() - stored.renewed_at < 1.0
        with pytest.raises(LeaseHeldError, match="busy host"):
            RunLease.acquire(store, RUN, "other host")


def test_the_renewal_thread_records_a_loss_that_check_raises(store_target):
    store = ArtifactStore(store_target.root_uri)
    lease = RunLease.acquire(store, RUN, "our host", ttl_s=3.0, renew_every_s=0.1)
    # A taker whose clock runs far ahead judged the lease expired and swapped its own in.
    data, version = store.read_versioned(LEASE)
    assert store.replace_if(LEASE, LeaseRecord.new("skewed host", 30).encode(), version)

    wait_for(lambda: not lease._thread.is_alive(), 5, "the renewal thread to stop")
    # More than 2 s of the ttl are left, so check() raises what the thread found; it renews nothing.
    with pytest.raises(LeaseLostError, match="skewed host"):
        lease.check()
    lease.release()
    assert stored_lease(store).holder == "skewed host"


# -- a real holder process -----------------------------------------------------------------------

HOLDER_CHILD = """
import os, sys, time
from infra.store import ArtifactStore, LeaseLostError, RunLease

root_uri, marker, lost_file, *run_ids = sys.argv[1:]
store, holder = ArtifactStore(root_uri), f"test child pid {os.getpid()}"
leases = [RunLease.acquire(store, run_id, holder, ttl_s=1.0) for run_id in run_ids]
open(marker, "w").close()
while leases:  # the distill flow: a rollout, then check()
    time.sleep(0.05)
    lost = []
    for lease in leases:
        try:
            lease.check()
        except LeaseLostError as exc:
            lost.append((lease, exc))
    for lease, exc in lost:
        leases.remove(lease)
        lease.release()  # must leave the new holder's lease alone
    if lost:
        with open(lost_file, "a") as file:
            file.writelines(f"{exc}\\n" for _, exc in lost)
time.sleep(600)
"""


def acquire_when_free(store: ArtifactStore, run_id: str, timeout_s: float) -> RunLease:
    def attempt() -> RunLease | None:
        try:
            return RunLease.acquire(store, run_id, "parent", ttl_s=30)
        except LeaseHeldError:
            return None

    return wait_for(attempt, timeout_s, f"the lease on {run_id} to expire")


def test_a_stopped_then_killed_holder_process(store_target, tmp_path):
    """One holder process with two run ids. Stopped past its ttl, it learns at its next check()
    that the lease taken meanwhile is lost, and keeps the one nobody took; killed, it leaves a
    lease that this host takes over at once (its process is gone), long before its ttl runs out."""
    store = ArtifactStore(store_target.root_uri)
    marker, lost_file = tmp_path / "holding", tmp_path / "lost"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER_CHILD, store_target.root_uri, str(marker), str(lost_file),
         "run-kept", "run-taken"],
        cwd=REPO_ROOT, env=dict(os.environ),
    )
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, 60, "the child's leases")
        assert child.poll() is None, "the holder exited before it held its leases"
        with pytest.raises(LeaseHeldError, match=f"test child pid {child.pid}"):
            RunLease.acquire(store, "run-taken", "parent")

        os.kill(child.pid, signal.SIGSTOP)  # as a suspended VM or a long swap storm would
        taken = acquire_when_free(store, "run-taken", timeout_s=5)
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: lost_file.exists() and lost_file.read_text(), 10, "the child's check")
        message = lost_file.read_text()
        assert "lost the lease" in message and "run-taken" in message and "parent" in message
        assert "run-kept" not in message
        taken.check()
        with pytest.raises(LeaseHeldError, match=f"test child pid {child.pid}"):
            RunLease.acquire(store, "run-kept", "parent")  # renewed again after the stop

        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        stored = store.read_versioned("run-kept/lease.json")
        left = LeaseRecord.decode(stored[0], "run-kept")  # never renewed again
        kept = RunLease.acquire(store, "run-kept", "parent", ttl_s=30)  # no wait: the holder is dead
        took_over_at = time.time()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert left.holder == f"test child pid {child.pid}"
    assert left.host == socket.gethostname() and left.pid == child.pid and took_over_at > 0
    stored = store.read_versioned("run-taken/lease.json")
    assert LeaseRecord.decode(stored[0], "run-taken").token == taken.token
    taken.release()
    kept.release()


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        {"holder": ""},
        {"holder": "x" * 501},
        {"holder": "h", "ttl_s": 0},
        {"holder": "h", "ttl_s": float("inf")},
        {"holder": "h", "ttl_s": 10, "renew_every_s": 10},
        {"holder": "h", "ttl_s": 10, "renew_every_s": 0},
    ],
)
def test_bad_arguments_are_refused_before_the_store_is_touched(tmp_path, arguments):
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    with pytest.raises(ValueError):
        RunLease.acquire(store, RUN, **arguments)
    with pytest.raises(ValueError):
        RunLease.acquire(store, "../escape", "h")
    assert not (tmp_path / "store").exists()


def test_a_malformed_lease_is_refused_naming_it(tmp_path):
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    store.put_json(LEASE, {"holder": "someone"})
    with pytest.raises(StoreError, match="not a lease this store wrote") as info:
        RunLease.acquire(store, RUN, "h")
    assert store.uri(LEASE) in str(info.value) and "delete it" in str(info.value)


def test_a_lease_of_a_dead_process_on_this_host_is_stale_before_its_expiry():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    fresh = LeaseRecord.new("somebody", ttl_s=600)
    assert fresh.is_live()  # this very process
    assert not dataclasses.replace(fresh, pid=gone.pid).is_live()
    assert dataclasses.replace(fresh, pid=gone.pid, host="another-host").is_live()  # trusted until expiry
    assert not dataclasses.replace(fresh, expires_at=time.time() - 1).is_live()

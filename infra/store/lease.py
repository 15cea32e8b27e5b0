"""One run per run id: a lease on the run id, the JSON object ``<run_id>/lease.json`` in the store.

It changes only by conditional writes on the version just read: acquire creates it if absent, else takes it over
only if stale (of two takers exactly one wins), else raises ``LeaseHeldError`` at once; renew replaces our version
(``LeaseLostError`` if it was taken meanwhile); release deletes it only if it holds our token. Expiry is judged by
the acquirer's clock, so hosts' clocks must agree to well within the ttl.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, astuple, dataclass, replace
from datetime import datetime, timezone

from infra.store.artifacts import ArtifactStore
from infra.store.faults import StoreError, describe
from infra.store.keys import shown, validate_name

logger = logging.getLogger(__name__)
LEASE_FORMAT = "dmd2-flows/lease-v1"
_MAX_HOLDER_CHARS = 500
# Each round follows someone else's change to the lease; more than a few means a fight to retry.
_ACQUIRE_ROUNDS = 3


class LeaseHeldError(StoreError):
    """The run id is leased to someone else whose lease has not expired."""

    def __init__(self, run_id: str, uri: str, holder: str, renewed_at: float, expires_at: float):
        self.run_id, self.uri, self.holder = run_id, uri, holder
        self.renewed_at, self.expires_at = renewed_at, expires_at
        now = time.time()
        super().__init__(
            f"run id {run_id!r} is in use: its lease {uri} is held by {holder}, last renewed {_when(renewed_at, now)}, "
            f"expiring {_when(expires_at, now)} unless renewed. Wait for that run to finish (if it died, its lease "
            "expires by itself), or use another run id.")

    def __reduce__(self) -> tuple:  # Prefect may ship it across processes
        return type(self), (self.run_id, self.uri, self.holder, self.renewed_at, self.expires_at)


class LeaseLostError(StoreError):
    """Our lease expired and someone else holds (or deleted) it now: stop writing to the run."""


@dataclass(frozen=True)
class LeaseRecord:
    """The stored lease: its holder, the holder's token, renewal and expiry times, and where it runs."""

    holder: str
    token: str
    renewed_at: float
    expires_at: float
    host: str = ""  # where the holding process runs, and its pid: a dead holder on this host is stale at once
    pid: int = 0

    @classmethod
    def new(cls, holder: str, ttl_s: float) -> LeaseRecord:
        now = time.time()
        return cls(holder, uuid.uuid4().hex, now, now + ttl_s, socket.gethostname(), os.getpid())

    def is_live(self) -> bool:
        """Unexpired, and not held by a process of this host that is gone (a run killed a moment ago need not
        block its rerun for a whole ttl; a holder on another host is trusted until expiry)."""
        if self.expires_at <= time.time():
            return False
        if self.host != socket.gethostname() or self.pid <= 0 or self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, owned by someone else
        return True

    def renewed(self, ttl_s: float) -> LeaseRecord:
        now = time.time()
        return replace(self, renewed_at=now, expires_at=now + ttl_s)

    def encode(self) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, **asdict(self)}, sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes, uri: str) -> LeaseRecord:
        """Parse a stored lease; ``StoreError`` naming ``uri`` if it is not one this code wrote."""
        try:
            document = json.loads(data.decode("utf-8"))
            if document.pop("format", None) != LEASE_FORMAT:
                raise ValueError("unknown format")
            record = cls(**document)  # TypeError for missing or extra fields
            types = (str, str, (int, float), (int, float), str, int)  # of the fields, in order
            if any(isinstance(v, bool) or not isinstance(v, t) for v, t in zip(astuple(record), types)):
                raise ValueError("holder, token and host must be strings, pid an integer, the times numbers")
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{uri} is not a lease this store wrote ({exc}); if no run uses this run id, "
                             "delete it") from exc
        return record

    def held_error(self, run_id: str, uri: str) -> LeaseHeldError:
        return LeaseHeldError(run_id, uri, self.holder, self.renewed_at, self.expires_at)


def _lease_key(run_id: str) -> str:
    # A file, not a folder: listings of rollouts and checkpoints (and so ``prune``) see only folders.
    return f"{validate_name(run_id, 'run id')}/lease.json"


def _read(store: ArtifactStore, key: str) -> tuple[LeaseRecord, str] | None:
    stored = store.read_versioned(key)
    return None if stored is None else (LeaseRecord.decode(stored[0], store.uri(key)), stored[1])


class RunLease:
    """A held lease on a run id (from ``RunLease.acquire``); a context manager that releases it on exit.
    Thread-safe: the background renewal, ``check`` and ``release`` may run in different threads."""

    def __init__(self, store: ArtifactStore, run_id: str, record: LeaseRecord, version: str, ttl_s: float,
                 renew_every_s: float, background: bool):
        self.store, self.run_id, self.ttl_s, self.renew_every_s = store, run_id, ttl_s, renew_every_s
        self.key = _lease_key(run_id)
        self.uri = store.uri(self.key)
        self.holder, self.token = record.holder, record.token
        self._record, self._version = record, version
        self._lock = threading.Lock()
        self._lost: str | None = None  # the LeaseLostError message, once the loss is known
        self._released = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._renew_until_released, name=f"lease-{run_id}", daemon=True)
            self._thread.start()

    @property
    def expires_at(self) -> float:
        """When the lease expires unless renewed (as of our last renewal), in unix seconds."""
        return self._record.expires_at

    def __repr__(self) -> str:
        return f"RunLease({self.uri!r}, holder={self.holder!r})"

    @staticmethod
    def check_free(store: ArtifactStore, run_id: str) -> None:
        """``LeaseHeldError`` if someone holds a live lease on ``run_id`` now; takes nothing (the CLI asks
        before Prefect and Ray start; ``acquire`` decides)."""
        key = _lease_key(run_id)
        if (stored := _read(store, key)) is not None and stored[0].is_live():
            raise stored[0].held_error(run_id, store.uri(key))

    @classmethod
    def acquire(cls, store: ArtifactStore, run_id: str, holder: str, ttl_s: float = 60.0,
                renew_every_s: float | None = None, *, background: bool = True) -> RunLease:
        """Lease ``run_id`` to ``holder`` (host, pid, flow run: a refused acquirer is told it) for ``ttl_s``, renewed
        every ``renew_every_s`` (default ``ttl_s / 3``) by a daemon thread, or with ``background=False`` by the
        caller (``renew``, ``check``). ``LeaseHeldError`` at once if a live lease is held; a stale one is taken over."""
        renew_every_s = ttl_s / 3 if renew_every_s is None else renew_every_s
        _check_arguments(holder, ttl_s, renew_every_s)
        key, ours = _lease_key(run_id), LeaseRecord.new(holder, ttl_s)
        uri = store.uri(key)
        for _ in range(_ACQUIRE_ROUNDS):
            record = ours.renewed(ttl_s)
            if (version := store.create_if_absent(key, record.encode())) is None:
                if (stored := _read(store, key)) is None:
                    continue  # released between the two calls: create again
                existing, current = stored
                if existing.token == ours.token:  # our write landed, but its answer was lost
                    record, version = existing, current
                elif existing.is_live():
                    raise existing.held_error(run_id, uri)
                else:
                    record = record.renewed(ttl_s)
                    if (version := store.replace_if(key, record.encode(), current)) is None:
                        continue  # another taker won, or the holder renewed: look again
                    logger.warning("took over the stale lease %s of %s (its process is gone, or it expired %s)",
                                   uri, existing.holder, _when(existing.expires_at, time.time()))
            return cls(store, run_id, record, version, ttl_s, renew_every_s, background)
        raise StoreError(f"the lease {uri} kept changing while it was being acquired; try again")

    def renew(self) -> None:
        """Extend the lease to ``ttl_s`` from now. ``LeaseLostError`` if it is not ours any more (then it stays
        lost); store faults propagate and leave it held as before."""
        with self._lock:
            self._raise_if_done()
            record = self._record.renewed(self.ttl_s)
            for _ in range(2):
                version = self.store.replace_if(self.key, record.encode(), self._version)
                if version is not None:
                    self._record, self._version = record, version
                    return
                self._version = self._read_ours()[1]  # ours, written by a renewal whose answer was lost
            raise StoreError(f"the lease {self.uri} kept changing while it was being renewed")

    def check(self) -> None:
        """``LeaseLostError`` if the lease was lost. No store call while the last renewal is fresh; once less
        than a third of the ttl is left (renewals fell behind) it renews, never vouching for an expired lease."""
        with self._lock:
            self._raise_if_done()
            stale = self._record.expires_at - time.time() < self.ttl_s / 3
        if stale:
            self.renew()

    def release(self) -> None:
        """Stop renewing and delete the lease if it still holds our token; idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._lost is not None:
                return
            stored = _read(self.store, self.key)
            if stored is None or stored[0].token != self.token:
                logger.warning("not deleting %s: %s", self.uri, self._loss_message(stored[0] if stored else None))
            elif not self.store.delete_if(self.key, stored[1]):
                logger.warning("not deleting %s: it changed while it was being released", self.uri)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.release()
        except Exception as exc:  # a lease left behind only delays the next run until it expires
            logger.warning("could not release %s (%s); it expires by itself %s", self.uri, describe(exc),
                           _when(self.expires_at, time.time()))

    def _read_ours(self) -> tuple[LeaseRecord, str]:
        """The stored lease and its version; ``LeaseLostError`` (and lost for good) unless it holds our token."""
        stored = _read(self.store, self.key)
        if stored is None or stored[0].token != self.token:
            self._lost = self._loss_message(stored[0] if stored else None)
            raise LeaseLostError(self._lost)
        return stored

    def _raise_if_done(self) -> None:
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        if self._released:
            raise StoreError(f"the lease {self.uri} was released")

    def _loss_message(self, current: LeaseRecord | None) -> str:
        now = time.time()
        who = ("it was deleted" if current is None
               else f"{current.holder} holds it (renewed {_when(current.renewed_at, now)})")
        return (f"lost the lease {self.uri} on run id {self.run_id!r}: {who}. Ours expired "
                f"{_when(self._record.expires_at, now)} without a renewal (was this process stopped, or cut off from "
                f"the store, for longer than its ttl of {self.ttl_s:g} s?). Stop this run: another may be training "
                "under this run id.")

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.renew()
            except LeaseLostError as exc:
                logger.error("%s", exc)  # check() raises it in the run's own thread
                return
            except Exception as exc:  # a store fault: the next round tries again
                if self._stop.is_set():
                    return
                logger.warning("could not renew %s (%s); trying again in %.3g s", self.uri, describe(exc),
                               self.renew_every_s)


def _check_arguments(holder: object, ttl_s: float, renew_every_s: float) -> None:
    if not isinstance(holder, str) or not holder.strip() or len(holder) > _MAX_HOLDER_CHARS:
        raise ValueError(f"the lease holder must describe who holds it (host, pid, flow run) in 1-"
                         f"{_MAX_HOLDER_CHARS} characters, got {shown(holder)}")
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {shown(ttl_s)}")
    if not (isinstance(renew_every_s, (int, float)) and 0 < renew_every_s < ttl_s):
        raise ValueError(f"renew_every_s must be > 0 and below ttl_s ({ttl_s:g} s), e.g. ttl_s / 3; "
                         f"got {shown(renew_every_s)}")


def _when(t: float, now: float) -> str:
    """An instant for a message: UTC time and how far it is from now."""
    stamp = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
    relative = f"{t - now:.1f} s from now" if t >= now else f"{now - t:.1f} s ago"
    return f"at {stamp} ({relative})"

"""The digest every stored object is checked against, computed on all cores.

A plain sha256 is one sequential stream: about 1 GB/s on one core, whatever the machine, so a
verified read of a 24 GB checkpoint would spend 25 s hashing while the other cores wait. The
store therefore hashes objects the way S3's composite checksums and BitTorrent's pieces do:

    digest(object) = sha256(sha256(piece_0) || sha256(piece_1) || ... )

where the pieces are the object's consecutive ``PIECE_BYTES`` bytes (the last one shorter; an
empty object has no pieces). The pieces are hashed in parallel; the digest is as hard to collide
as sha256 itself (a collision of the list implies one of sha256), and a different length changes
the last piece. It is what ``ArtifactRef.sha256`` and every MANIFEST.json entry hold. ``sha256sum``
does not compute it; this module does:

    python -m infra.store.digest FILE...

Three ways to compute it, one per way the bytes arrive:

- ``piecewise_sha256(buffer)``: bytes already in memory;
- ``PiecewiseSha256``: bytes that arrive as a stream (a write, an upload); pieces are
  hashed on the pool while the caller moves the next bytes;
- ``hash_spans(size, read_span)``: bytes read at known offsets (a local file, ranges of an S3
  object), into a buffer (``fill_hashing``) or a file; each pool thread reads a span and hashes
  it at once, while it is still in that core's cache.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

PIECE_BYTES = 2**20
# hashlib releases the GIL on large buffers, so threads hash on separate cores. Past 16, a
# piece-wise read is bound by memory bandwidth, not by sha256.
_MAX_HASH_THREADS = 16

Buffer = bytes | bytearray | memoryview

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # the process that started _pool: a forked child inherits the object, not its threads
_pool_lock = threading.Lock()


def hash_threads() -> int:
    """How many threads hash pieces: the cores this process may use, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, _MAX_HASH_THREADS))


def _hash_pool() -> ThreadPoolExecutor:
    """The process's pool of hashing threads, started on first use and shared by all hashers.

    No task run on it ever waits on another, so sharing cannot deadlock.
    """
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(hash_threads(), thread_name_prefix="store-digest")
            _pool_pid = os.getpid()
        return _pool


def _piece_digest(piece: Buffer) -> bytes:
    return hashlib.sha256(piece).digest()


def _combine(piece_digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(piece_digests)).hexdigest()


def piecewise_sha256(data: Buffer) -> str:
    """The store's digest of ``data`` (see the module docstring); pieces hashed in parallel."""
    with PiecewiseSha256() as hasher:
        hasher.update(data)
        return hasher.hexdigest()


class PiecewiseSha256:
    """The store's digest of a stream of buffers, computed on the hashing pool as they arrive.

    ``update`` cuts what it is given into pieces (whatever the buffers' sizes: a piece that spans
    two buffers is copied, every other one is hashed in place), queues them and returns. The
    caller must not change a buffer before ``hexdigest`` returns. With ``max_backlog``, ``update``
    first waits while that many pieces are still queued, which bounds the memory a fast reader
    can pile up. Use it as a context manager: leaving the block drops the queued pieces, also when
    the caller failed midway, and waits for those being hashed (so no thread reads a buffer its
    caller is done with).
    """

    def __init__(self, max_backlog: int | None = None):
        self._pool = _hash_pool()
        self._pieces: list[Future[bytes]] = []
        self._queued: deque[Future[bytes]] = deque()
        self._partial = bytearray()  # the start of a piece whose end has not arrived yet
        self._max_backlog = max_backlog
        self._digest: str | None = None

    def __enter__(self) -> PiecewiseSha256:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for piece in self._queued:
            piece.cancel()
        futures.wait([piece for piece in self._queued if not piece.cancelled()])

    def update(self, data: Buffer) -> None:
        """Queue ``data``, the next bytes of the object."""
        if self._digest is not None:
            raise RuntimeError("update() after hexdigest(): the digest is final")
        view = memoryview(data).cast("B")
        if self._partial:
            taken = view[: PIECE_BYTES - len(self._partial)]
            self._partial += taken
            view = view[len(taken) :]
            if len(self._partial) < PIECE_BYTES:
                return
            self._queue(bytes(self._partial))
            self._partial.clear()
        whole = len(view) - len(view) % PIECE_BYTES
        for start in range(0, whole, PIECE_BYTES):
            self._queue(view[start : start + PIECE_BYTES])
        self._partial += view[whole:]

    def _queue(self, piece: Buffer) -> None:
        if self._max_backlog is not None:
            while len(self._queued) >= self._max_backlog:
                self._queued.popleft().result()
        future = self._pool.submit(_piece_digest, piece)
        self._pieces.append(future)
        self._queued.append(future)

    def hexdigest(self) -> str:
        """The digest of every byte given so far, once all pieces are hashed. Final."""
        if self._digest is None:
            if self._partial:
                self._queue(bytes(self._partial))
                self._partial.clear()
            self._digest = _combine([piece.result() for piece in self._pieces])
            self._queued.clear()
        return self._digest


ReadAt = Callable[[memoryview, int], int]


def read_fully(read_at: ReadAt, region: memoryview, offset: int) -> int:
    """Fill ``region`` with the object's bytes from ``offset`` through ``read_at(view, offset)``
    (which may read fewer bytes than asked, as ``os.preadv`` and network reads do); return the
    count, short only where the object ends."""
    filled = 0
    while filled < len(region):
        count = read_at(region[filled:], offset + filled)
        if not count:
            break
        filled += count
    return filled


def hash_spans(size: int, read_span: Callable[[int, int], Buffer], span: int) -> tuple[str, int]:
    """The digest of an object of ``size`` bytes, read in spans in parallel; (digest, bytes read).

    ``read_span(start, length)`` brings in the object's bytes ``[start, start + length)`` (where
    it likes: the caller's buffer, a file) and returns them, fewer only where the object ends.
    Spans (a multiple of the piece size: one piece for a local file, so that it is hashed while in
    the reading core's cache; several for a network read, to make fewer requests) run in parallel
    on the pool, and each span's pieces are hashed by the thread that read them. A short span
    ends the object: what was read is hashed, and the caller's check of the digest fails.
    """
    if span <= 0 or span % PIECE_BYTES:
        raise ValueError(f"span must be a positive multiple of {PIECE_BYTES}, got {span}")
    starts = range(0, size, span)

    def read_and_hash(start: int) -> tuple[list[bytes], int]:
        data = memoryview(read_span(start, min(span, size - start))).cast("B")
        pieces = range(0, len(data), PIECE_BYTES)
        return [_piece_digest(data[at : at + PIECE_BYTES]) for at in pieces], len(data)

    spans = [_hash_pool().submit(read_and_hash, start) for start in starts]
    try:
        results = [result.result() for result in spans]
    finally:  # on a failed read, stop the rest before the caller frees its buffers
        for result in spans:
            result.cancel()
        futures.wait([result for result in spans if not result.cancelled()])
    digests, total = [], 0
    for start, (span_digests, count) in zip(starts, results):
        digests += span_digests
        total += count
        if count < min(span, size - start):
            break
    return _combine(digests), total


def fill_hashing(dest: memoryview, read_at: ReadAt, span: int = PIECE_BYTES) -> tuple[str, int]:
    """Fill ``dest`` with an object through ``read_at(view, offset)`` (``os.preadv`` is one),
    spans in parallel (``hash_spans``); return (digest, bytes filled)."""
    view = memoryview(dest).cast("B")

    def read_span(start: int, length: int) -> memoryview:
        region = view[start : start + length]
        return region[: read_fully(read_at, region, start)]

    return hash_spans(len(view), read_span, span)


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    """(digest, size) of a local file, read in chunks while the pool hashes the pieces."""
    size = 0
    # A backlog of two pieces per thread keeps every thread busy and bounds the memory.
    with open(path, "rb") as file, PiecewiseSha256(max_backlog=2 * hash_threads()) as hasher:
        while chunk := file.read(PIECE_BYTES):
            hasher.update(chunk)
            size += len(chunk)
        return hasher.hexdigest(), size

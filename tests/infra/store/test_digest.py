"""Tests of infra/store/digest.py: the store's piece-wise sha256, however the bytes arrive."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

import pytest

from infra.store.digest import (
    PiecewiseSha256,
    file_digest,
    fill_hashing,
    hash_threads,
    piecewise_sha256,
)
from tests.infra.store.digest_reference import PIECE, reference_digest

# Empty, shorter than a piece, exactly one, one byte either side of a boundary, several.
SIZES = [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE, 3 * PIECE + 12345]


@pytest.mark.parametrize("size", SIZES)
def test_digest_of_a_buffer_matches_the_reference(size):
    data = os.urandom(size)
    assert piecewise_sha256(data) == reference_digest(data)


def test_digest_is_not_a_plain_sha256_and_sees_every_byte():
    import hashlib

    data = bytearray(os.urandom(2 * PIECE + 7))
    digest = piecewise_sha256(data)
    assert digest != hashlib.sha256(data).hexdigest()
    for position in (0, PIECE - 1, PIECE, len(data) - 1):
        flipped = bytearray(data)
        flipped[position] ^= 1
        assert piecewise_sha256(flipped) != digest, position
    assert piecewise_sha256(data[:-1]) != digest  # a shorter object, same pieces but the last


@pytest.mark.parametrize("max_backlog", [None, 1, 3])
def test_a_stream_cut_anywhere_gives_the_same_digest(max_backlog):
    """Buffers of any sizes: pieces that span buffers are joined, empty buffers change nothing."""
    sizes = [0, 1, 5000, 3 * PIECE, 17, PIECE, PIECE - 5018, 0, 2 * PIECE + 3]
    buffers = [os.urandom(size) for size in sizes]
    with PiecewiseSha256(max_backlog=max_backlog) as hasher:
        for buffer in buffers:
            hasher.update(memoryview(buffer))
        digest = hasher.hexdigest()
    assert digest == reference_digest(b"".join(buffers))


def test_digest_is_final():
    with PiecewiseSha256() as hasher:
        hasher.update(b"abc")
        digest = hasher.hexdigest()
        assert hasher.hexdigest() == digest == reference_digest(b"abc")
        with pytest.raises(RuntimeError, match="final"):
            hasher.update(b"d")


def test_a_failed_caller_leaves_no_piece_queued():
    """Leaving the block on an error drops the queued pieces and waits for the running ones,
    so no thread still reads the caller's buffers; the pool keeps serving other hashers."""
    buffers = [bytearray(os.urandom(4 * PIECE)) for _ in range(4)]
    with pytest.raises(RuntimeError, match="write failed"):
        with PiecewiseSha256() as hasher:
            for buffer in buffers:
                hasher.update(buffer)
            raise RuntimeError("write failed")
    assert all(piece.done() for piece in hasher._queued)
    assert piecewise_sha256(buffers[0]) == reference_digest(bytes(buffers[0]))


def _pread_from(data: bytes):
    def read_at(piece: memoryview, offset: int) -> int:
        source = data[offset : offset + len(piece)]
        piece[: len(source)] = source
        return len(source)

    return read_at


@pytest.mark.parametrize("size", SIZES)
def test_fill_hashing_reads_every_byte_and_hashes_it(size):
    data = os.urandom(size)
    dest = memoryview(bytearray(size))
    assert fill_hashing(dest, _pread_from(data)) == (reference_digest(data), size)
    assert dest.tobytes() == data


@pytest.mark.parametrize("size", [0, 1, 3 * PIECE - 1, 3 * PIECE, 7 * PIECE + 5])
def test_fill_hashing_in_spans_of_several_pieces(size):
    """A network read fetches several pieces per request; the digest is still per piece."""
    data = os.urandom(size)
    calls = []

    def read_at(region: memoryview, offset: int) -> int:
        calls.append((offset, len(region)))
        return _pread_from(data)(region, offset)

    dest = memoryview(bytearray(size))
    assert fill_hashing(dest, read_at, span=3 * PIECE) == (reference_digest(data), size)
    assert dest.tobytes() == data
    assert sorted(calls) == [(at, min(3 * PIECE, size - at)) for at in range(0, size, 3 * PIECE)]
    with pytest.raises(ValueError, match="multiple"):
        fill_hashing(dest, read_at, span=PIECE + 1)


def test_fill_hashing_of_a_shorter_object_hashes_what_is_there():
    """A file that shrank after its size was taken: the digest is that of the shorter bytes."""
    data = os.urandom(2 * PIECE + 10)
    dest = memoryview(bytearray(5 * PIECE))
    assert fill_hashing(dest, _pread_from(data)) == (reference_digest(data), len(data))
    assert fill_hashing(dest, _pread_from(data), span=2 * PIECE) == (reference_digest(data), len(data))


def test_fill_hashing_reads_the_rest_of_a_piece_after_a_short_read():
    """read_at may return fewer bytes than asked (as a pipe or a network read does)."""
    data = os.urandom(2 * PIECE + 10)

    def read_little(piece: memoryview, offset: int) -> int:
        return _pread_from(data)(piece[:1000], offset)

    dest = memoryview(bytearray(len(data)))
    assert fill_hashing(dest, read_little) == (reference_digest(data), len(data))


def test_fill_hashing_raises_the_reader_s_error():
    def failing(piece: memoryview, offset: int) -> int:
        if offset >= PIECE:
            raise OSError("disk gone")
        piece[:] = bytes(len(piece))
        return len(piece)

    with pytest.raises(OSError, match="disk gone"):
        fill_hashing(memoryview(bytearray(4 * PIECE)), failing)


def test_hashers_on_many_threads_share_the_pool():
    data = [os.urandom(2 * PIECE + n) for n in range(6)]
    results: dict[int, str] = {}

    def work(index: int) -> None:
        results[index] = piecewise_sha256(data[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(data))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: reference_digest(d) for i, d in enumerate(data)}
    assert 1 <= hash_threads() <= 16


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_hashes_with_its_own_threads():
    """A child forked after the pool started inherits the pool object but none of its threads;
    it must start its own pool, not queue pieces that nothing will ever hash."""
    data = os.urandom(3 * PIECE)
    assert piecewise_sha256(data) == reference_digest(data)  # the parent's pool is running
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hash, report, exit without running the parent's test teardown
        try:
            os.write(write_end, piecewise_sha256(data).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        if not ready:  # the child is stuck (pieces queued on threads it does not have)
            os.kill(pid, signal.SIGKILL)
        with os.fdopen(read_end, "rb") as pipe:
            reported = pipe.read().decode() if ready else "nothing within 30 s"
    finally:
        os.waitpid(pid, 0)
    assert reported == reference_digest(data)


def test_file_digest_and_the_command_line(tmp_path):
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(os.urandom(PIECE + 3))
    second.write_bytes(b"")
    assert file_digest(first) == (reference_digest(first.read_bytes()), PIECE + 3)
    result = subprocess.run(
        [sys.executable, "-m", "infra.store", str(first), str(second)],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.splitlines() == [
        f"{reference_digest(first.read_bytes())}  {first}",
        f"{reference_digest(b'')}  {second}",
    ]
    missing = subprocess.run(
        [sys.executable, "-m", "infra.store", str(tmp_path / "nope")],
        capture_output=True, text=True,
    )
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "nope" in missing.stderr

"""Independent, deliberately plain computations of the store's digests, for tests to compare to: the plain
sha256 (what the store keeps now, what sha256sum prints), and the piece-wise digest of stores written before
manifest format v2 (sha256 of the concatenated sha256 digests of the object's consecutive 1 MiB pieces)."""

import hashlib

PIECE = 1 << 20  # written out, not imported: the legacy piece size is fixed by the stores already written


def reference_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def legacy_digest(data: bytes) -> str:
    pieces = [data[start : start + PIECE] for start in range(0, len(data), PIECE)]
    return hashlib.sha256(b"".join(hashlib.sha256(piece).digest() for piece in pieces)).hexdigest()

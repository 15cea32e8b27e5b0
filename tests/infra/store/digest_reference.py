"""An independent, deliberately plain computation of the store's digest, for tests to compare to:
sha256 of the concatenated sha256 digests of the object's consecutive 1 MiB pieces."""

import hashlib

PIECE = 1 << 20  # written out, not imported: a change of the store's piece size must fail tests


def reference_digest(data: bytes) -> str:
    pieces = [data[start : start + PIECE] for start in range(0, len(data), PIECE)]
    return hashlib.sha256(b"".join(hashlib.sha256(piece).digest() for piece in pieces)).hexdigest()

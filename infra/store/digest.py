"""The digest every stored object is checked against: the plain sha256 of its bytes, what ``sha256sum`` prints.

Stores written before manifest format v2 hold a piece-wise digest instead (sha256 of the concatenated sha256s
of the object's 1 MiB pieces); it is computed only when the plain one does not match, so they still verify.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from infra.store.faults import IntegrityError

LEGACY_PIECE_BYTES = 2**20


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def legacy_sha256(data: bytes | bytearray | memoryview) -> str:
    view = memoryview(data).cast("B")
    pieces = (hashlib.sha256(view[at : at + LEGACY_PIECE_BYTES]).digest()
              for at in range(0, len(view), LEGACY_PIECE_BYTES))
    return hashlib.sha256(b"".join(pieces)).hexdigest()


def file_sha256(path: str | os.PathLike, legacy: bool = False) -> str:
    """The plain (or ``legacy``) digest of a local file, read in pieces."""
    plain, outer = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(LEGACY_PIECE_BYTES):
            plain.update(piece)
            if legacy:
                outer.update(hashlib.sha256(piece).digest())
    return outer.hexdigest() if legacy else plain.hexdigest()


def verify(uri: str, expected: str, actual: str, legacy: Callable[[], str], detail: str = "") -> None:
    """``IntegrityError`` unless ``actual`` (the plain sha256) or, for an older store's object, ``legacy()`` is
    the ``expected`` digest."""
    if actual != expected and legacy() != expected:
        raise IntegrityError(uri, expected, actual, detail)

"""References to stored artifacts: what tasks hand each other instead of tensors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from infra.store.keys import is_sha256

KINDS = ("tensors", "json", "dir")


@dataclass(frozen=True)
class ArtifactRef:
    """A stored artifact: its URI, the plain sha256 of its bytes (for a ``dir``: of its MANIFEST.json, which
    lists each file's), its size (a directory's: the sum of its files') and kind. Plain fields, so Prefect can
    persist it; ``to_dict``/``from_dict`` and ``to_json``/``from_json`` round-trip it exactly."""

    uri: str
    sha256: str
    nbytes: int
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or "://" not in self.uri:
            raise ValueError(f"ArtifactRef.uri must be a URI string, got {type(self.uri).__name__}")
        if not is_sha256(self.sha256):
            raise ValueError("ArtifactRef.sha256 must be 64 lowercase hex digits")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"ArtifactRef.nbytes must be an int >= 0, got {self.nbytes!r}")
        if self.kind not in KINDS:
            raise ValueError(f"ArtifactRef.kind must be one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict[str, str | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArtifactRef:
        """Inverse of ``to_dict``; refuses missing or unknown fields."""
        names = {field.name for field in fields(cls)}
        if set(data) != names:
            raise ValueError(f"an ArtifactRef needs exactly the fields {sorted(names)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArtifactRef:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory of a run: its step and the ref to pass to ``get_dir``."""

    step: int
    ref: ArtifactRef

"""Keys, refs and manifests of the artifact store.

A key is a relative '/'-separated path whose every part matches ``[A-Za-z0-9_][A-Za-z0-9._-]*``: it cannot climb
out of the root (``..``), be absolute, carry a scheme (``s3://other``) or collide with the store's hidden staging
names (leading ``.``). Layout::

    <root>/<run_id>/rollout-<n>/<task>/rank-<r>.safetensors
    <root>/<run_id>/checkpoints/<step>/...            (a directory with MANIFEST.json)
    <root>/<run_id>/checkpoints/<step>-rank-<r>/...   (rank r's part of it, when rank r holds shards)
    <root>/<run_id>/quarantine/<step>-<time>/...      (a damaged checkpoint, moved aside, never deleted)
    <root>/<run_id>/lease.json                        (who runs the run now: ``infra.store.lease``; a file, so
                                                       listings of rollouts and checkpoints never see it)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

MANIFEST_NAME = "MANIFEST.json"
# v2: entries hold the plain sha256 of each file; v1 (older stores, still read) a piece-wise one.
MANIFEST_FORMATS = ("dmd2-flows/manifest-v2", "dmd2-flows/manifest-v1")
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"
KINDS = ("tensors", "json", "dir")
ROLLOUT_DIR = re.compile(r"rollout-(0|[1-9][0-9]*)")
STEP_DIR = re.compile(r"(0|[1-9][0-9]*)")
STEP_OR_PART_DIR = re.compile(r"(0|[1-9][0-9]*)(-rank-[0-9]+)?")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def shown(value: object) -> str:
    """A bad value for an error message; withheld if it might carry userinfo (``key:secret@``)."""
    text = repr(value)
    return "<withheld: contains '@'>" if "@" in text else text[:200]


def checked_int(value: object, what: str, minimum: int = 0) -> int:
    """``value`` if it is an int >= ``minimum``, else ``ValueError`` (a bool is refused: a True rank is a bug)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {shown(value)}")
    return value


def checked_sha256(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise ValueError(f"{what} must be 64 lowercase hex digits, got {shown(value)}")
    return value


def validate_name(name: object, what: str = "name") -> str:
    """``name`` if it is one safe path part, else ``ValueError`` saying why."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid {what} {shown(name)}: use 1-255 characters from [A-Za-z0-9._-], not starting "
                         "with '.' or '-' (no '/', '..', absolute paths or URI schemes)")
    return name


def validate_key(key: object) -> str:
    """``key`` if every '/'-separated part passes ``validate_name`` (so no empty part), else ``ValueError``."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid key {shown(key)}: expected a non-empty relative path")
    for part in key.split("/"):
        validate_name(part, what=f"part of key {shown(key)}:")
    return key


def rollout_prefix(run_id: str, rollout: int) -> str:
    return f"{validate_name(run_id, 'run id')}/rollout-{checked_int(rollout, 'rollout')}"


def rollout_key(run_id: str, rollout: int, task: str, rank: int) -> str:
    """The key of one rank's tensors for one task of one rollout."""
    validate_name(task, "task name")
    return f"{rollout_prefix(run_id, rollout)}/{task}/rank-{checked_int(rank, 'rank')}.safetensors"


def checkpoint_key(run_id: str, step: int) -> str:
    return f"{validate_name(run_id, 'run id')}/{CHECKPOINTS_DIR}/{checked_int(step, 'step')}"


def part_key(key: str, rank: int) -> str:
    """The key of rank ``rank``'s part of the checkpoint at ``key`` (a sibling: not a step folder)."""
    return f"{key}-rank-{checked_int(rank, 'rank')}"


def number_in(name: str, pattern: re.Pattern) -> int | None:
    """The number of a folder named as ``pattern`` (``ROLLOUT_DIR``, ``STEP_DIR``...), or None for any other
    name (staging folders, strays)."""
    match = pattern.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ArtifactRef:
    """A stored artifact, what tasks hand each other instead of tensors: its URI, the plain sha256 of its bytes
    (a ``dir``'s: of its MANIFEST.json, which lists each file's), its size (a dir's: the sum of its files') and
    kind. Plain fields, so Prefect can persist it; its dict and JSON forms round-trip it exactly."""

    uri: str
    sha256: str
    nbytes: int
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or "://" not in self.uri:
            raise ValueError(f"ArtifactRef.uri must be a URI string, got {type(self.uri).__name__}")
        checked_sha256(self.sha256, "ArtifactRef.sha256")
        checked_int(self.nbytes, "ArtifactRef.nbytes")
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


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a stored directory: its relative path (a key, so that a hostile manifest cannot make get_dir
    write outside its destination), size and sha256 (piece-wise in a v1 manifest)."""

    path: str
    nbytes: int
    sha256: str

    def __post_init__(self) -> None:
        validate_key(self.path)
        checked_int(self.nbytes, "nbytes")
        checked_sha256(self.sha256, "sha256")


def encode_manifest(entries: list[ManifestEntry]) -> bytes:
    """Entries sorted by path, so equal trees give equal bytes."""
    files = [asdict(entry) for entry in sorted(entries, key=lambda entry: entry.path)]
    return json.dumps({"format": MANIFEST_FORMATS[0], "files": files}, sort_keys=True, indent=1).encode("utf-8")


def decode_manifest(data: bytes, uri: str) -> list[ManifestEntry]:
    """Parse and check a manifest (v2 or v1); ``ValueError`` naming ``uri`` if it is malformed."""
    try:
        document = json.loads(data.decode("utf-8"))
        if document.get("format") not in MANIFEST_FORMATS:
            raise ValueError(f"unknown format {shown(document.get('format'))}")
        entries = [ManifestEntry(**item) for item in document["files"]]  # TypeError for missing or extra fields
        paths = [entry.path for entry in entries]
        if len(set(paths)) != len(paths) or MANIFEST_NAME in paths:
            raise ValueError("duplicate or reserved paths")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed manifest at {uri}: {exc}") from exc
    return entries

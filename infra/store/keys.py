"""Names, keys and manifests of the artifact store.

A *key* is a relative, '/'-separated path below the store's root whose every part matches
``[A-Za-z0-9_][A-Za-z0-9._-]*``: no key can climb out of the root (``..``), be absolute, carry another scheme
(``s3://other``) or collide with the store's hidden staging names (leading ``.``). Layout::

    <root>/<run_id>/rollout-<n>/<task>/rank-<r>.safetensors
    <root>/<run_id>/checkpoints/<step>/...            (a directory with MANIFEST.json)
    <root>/<run_id>/checkpoints/<step>-rank-<r>/...   (rank r's part of it, when rank r holds shards)
    <root>/<run_id>/quarantine/<step>-<time>/...      (a damaged checkpoint, moved aside, never deleted)
    <root>/<run_id>/lease.json                        (who runs the run now: ``infra.store.lease``)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MANIFEST_NAME = "MANIFEST.json"
# v2: entries hold the plain sha256 of each file; v1 (older stores, still read) a piece-wise one.
MANIFEST_FORMAT = "dmd2-flows/manifest-v2"
MANIFEST_FORMATS = (MANIFEST_FORMAT, "dmd2-flows/manifest-v1")
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"
# A file, not a folder: listings of rollouts and checkpoints (and so ``prune``) see only folders.
LEASE_NAME = "lease.json"

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_ROLLOUT_DIR_RE = re.compile(r"rollout-(0|[1-9][0-9]*)")
_STEP_DIR_RE = re.compile(r"(0|[1-9][0-9]*)(-rank-[0-9]+)?")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def shown(value: object) -> str:
    """A bad value for an error message; withheld if it might carry userinfo (``key:secret@``)."""
    text = repr(value)
    return "<withheld: contains '@'>" if "@" in text else text[:200]


def validate_name(name: object, what: str = "name") -> str:
    """``name`` if it is one safe path part (1-255 of ``[A-Za-z0-9._-]``, not starting with ``.`` or ``-``),
    else ``ValueError`` saying why."""
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


def _validate_index(value: object, what: str) -> int:
    # bool is an int subclass; a True rank is a bug, not rank 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"invalid {what} {shown(value)}: expected an int >= 0")
    return value


def rollout_prefix(run_id: str, rollout: int) -> str:
    return f"{validate_name(run_id, 'run id')}/rollout-{_validate_index(rollout, 'rollout')}"


def rollout_key(run_id: str, rollout: int, task: str, rank: int) -> str:
    """The key of one rank's tensors for one task of one rollout (``ValueError`` on an unsafe part)."""
    validate_name(task, "task name")
    return f"{rollout_prefix(run_id, rollout)}/{task}/rank-{_validate_index(rank, 'rank')}.safetensors"


def checkpoints_prefix(run_id: str) -> str:
    return f"{validate_name(run_id, 'run id')}/{CHECKPOINTS_DIR}"


def checkpoint_key(run_id: str, step: int) -> str:
    return f"{checkpoints_prefix(run_id)}/{_validate_index(step, 'step')}"


def part_key(key: str, rank: int) -> str:
    """The key of rank ``rank``'s part of the checkpoint at ``key`` (a sibling: not a step folder)."""
    return f"{key}-rank-{_validate_index(rank, 'rank')}"


def lease_key(run_id: str) -> str:
    return f"{validate_name(run_id, 'run id')}/{LEASE_NAME}"


def parse_rollout_dir(name: str) -> int | None:
    """The rollout number of a folder named ``rollout-<n>``, or None for any other name."""
    match = _ROLLOUT_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def parse_step_dir(name: str, parts: bool = False) -> int | None:
    """The step of a checkpoint folder ``<step>`` (with ``parts``, also of a rank's part ``<step>-rank-<r>``),
    or None (staging folders, strays)."""
    match = _STEP_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match and (parts or not match.group(2)) else None


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a stored directory: its relative path, size and sha256 (piece-wise in a v1 manifest)."""

    path: str
    nbytes: int
    sha256: str


def encode_manifest(entries: list[ManifestEntry]) -> bytes:
    """Serialise entries deterministically (sorted by path), so equal trees give equal bytes."""
    files = [{"path": e.path, "nbytes": e.nbytes, "sha256": e.sha256} for e in sorted(entries, key=lambda e: e.path)]
    return json.dumps({"format": MANIFEST_FORMAT, "files": files}, sort_keys=True, indent=1).encode("utf-8")


def decode_manifest(data: bytes, uri: str) -> list[ManifestEntry]:
    """Parse and check a manifest (v2 or v1); ``ValueError`` naming ``uri`` if it is malformed. Every path is
    validated as a key: a hostile manifest must not make get_dir write outside its destination."""
    try:
        document = json.loads(data.decode("utf-8"))
        if document.get("format") not in MANIFEST_FORMATS:
            raise ValueError(f"unknown format {shown(document.get('format'))}")
        entries = [_decode_entry(item) for item in document["files"]]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed manifest at {uri}: {exc}") from exc
    paths = [e.path for e in entries]
    if len(set(paths)) != len(paths) or MANIFEST_NAME in paths:
        raise ValueError(f"malformed manifest at {uri}: duplicate or reserved paths")
    return entries


def _decode_entry(item: dict) -> ManifestEntry:
    if set(item) != {"path", "nbytes", "sha256"}:
        raise ValueError(f"unexpected entry fields {sorted(item)}")
    if isinstance(item["nbytes"], bool) or not isinstance(item["nbytes"], int) or item["nbytes"] < 0:
        raise ValueError(f"bad nbytes {shown(item['nbytes'])}")
    if not is_sha256(item["sha256"]):
        raise ValueError(f"bad sha256 {shown(item['sha256'])}")
    return ManifestEntry(validate_key(item["path"]), item["nbytes"], item["sha256"])

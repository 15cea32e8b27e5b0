"""`ArtifactStore`: put and get verified tensors, JSON and directories; list, find and prune runs."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from infra.store import keys as store_keys
from infra.store.faults import ArtifactExistsError, RetryPolicy, StoreWriteError, check_sha256
from infra.store.digest import file_digest, piecewise_sha256
from infra.store.io import hidden_sibling, list_local_files
from infra.store.keys import MANIFEST_NAME, ManifestEntry, validate_key, validate_name
from infra.store.local import LocalBackend
from infra.store.refs import ArtifactRef, Checkpoint
from infra.store.s3 import S3Backend

logger = logging.getLogger(__name__)

Backend = LocalBackend | S3Backend
# A write's staging untouched this long belongs to a writer that died (a live one keeps writing).
STALE_STAGING_S = 3600.0
# Why a filesystem refuses a write; waiting does not cure any of them.
REFUSED_WRITES = {errno.ENOSPC: "no space left", errno.EDQUOT: "over the disk quota", errno.EROFS: "read-only",
                  errno.EACCES: "no permission", errno.EPERM: "not permitted", errno.EFBIG: "file too large"}


def open_backend(root_uri: str, retry: RetryPolicy) -> Backend:
    """The backend for ``root_uri``: a folder (``file://...`` or a bare path) or ``s3://...``.

    Raises ``ValueError`` for other schemes and for URIs that embed credentials (user info,
    ``s3://key:secret@bucket``, ``file://user@host/...``): refused, not stripped, because credentials
    belong in the standard AWS settings and a stripped URI would quietly use whatever those hold;
    such a URI is never echoed back.
    """
    if not isinstance(root_uri, str) or not root_uri:
        raise ValueError("the store root must be a non-empty URI, e.g. file:///data/artifacts")
    scheme, separator, rest = root_uri.partition("://")
    if not separator:
        return LocalBackend(root_uri)
    authority, _, path = rest.partition("/")
    if "@" in authority:
        raise ValueError(
            "the store URI must not embed credentials (user info before the bucket or host): for S3 set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the environment instead"
        )
    if scheme == "file":
        return LocalBackend(rest)
    if scheme in ("s3", "s3a"):
        bucket, prefix = authority, path.strip("/")
        return S3Backend(bucket, validate_key(prefix) if prefix else "", retry)
    raise ValueError(
        f"unsupported store scheme {scheme[:16]!r}: use file://<folder> or s3://<bucket>/<prefix>"
    )


class ArtifactStore:
    """Put and get verified artifacts below ``root_uri`` (``file://``, a bare path, or ``s3://``).

    ``retry`` bounds the retries of transient S3 faults (default ``RetryPolicy()``). The store
    holds no credential: S3 settings come from the standard AWS environment and config files.
    It pickles as its root URI and policy, so it can be sent to rank workers and Prefect tasks.
    """

    rollout_key = staticmethod(store_keys.rollout_key)
    checkpoint_key = staticmethod(store_keys.checkpoint_key)

    def __init__(self, root_uri: str, retry: RetryPolicy | None = None):
        self.retry = retry or RetryPolicy()
        self._backend = open_backend(root_uri, self.retry)

    @property
    def root_uri(self) -> str:
        """The canonical root: ``file:///abs/folder`` or ``s3://bucket[/prefix]``, no trailing /."""
        return self._backend.root_uri

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root_uri!r})"

    def __reduce__(self) -> tuple:
        return (type(self), (self.root_uri, self.retry))

    def uri(self, key: str) -> str:
        """The URI that ``key`` has in this store."""
        return self._backend.uri_of(validate_key(key))

    # -- tensors and JSON ----------------------------------------------------------------------

    def put_tensors(self, key: str, tensors: Mapping[str, torch.Tensor], durable: bool = True) -> ArtifactRef:
        """Store a dict of tensors as one safetensors object at ``key``; overwrites atomically.

        Any dtype of ``infra.store.tensors.DTYPE_NAMES`` (fp32, bf16, fp16, int64, ...); tensors must be
        contiguous and must not share memory (safetensors' rules), and must not change until
        this returns. Returns the ref to hand on.

        ``durable=False`` is for objects that are made again after a machine crash (a rollout's payloads,
        from the last checkpoint): the write is still atomic, but the file:// backend does not wait for
        the disk (fsync), so a crash may lose it; it never leaves a torn object under the key, as the
        digest in its ref would catch one.
        """
        validate_key(key)
        with self._refused_writes(key):
            digest, nbytes = self._backend.write_tensors(key, dict(tensors), durable)
        return self._new_ref(key, digest, nbytes, "tensors")

    def get_tensors(self, ref: ArtifactRef, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Load the tensors of ``ref`` after verifying its digest (``IntegrityError`` if not).

        The tensors are parsed from the very bytes that were hashed, into private memory: what
        happens to the stored object later cannot change them.
        """
        key = self._key_of(ref, "tensors")
        return self._backend.load_tensors(key, ref.uri, ref.sha256, ref.nbytes, device)

    def put_json(self, key: str, obj: Any) -> ArtifactRef:
        """Store ``obj`` as JSON at ``key`` (sorted keys; NaN/Infinity as Python's json writes)."""
        validate_key(key)
        data = json.dumps(obj, sort_keys=True).encode("utf-8")
        with self._refused_writes(key):
            digest = self._backend.write_bytes(key, data)
        return self._new_ref(key, digest, len(data), "json")

    def get_json(self, ref: ArtifactRef) -> Any:
        """The JSON value of ``ref``, after verifying its digest."""
        key = self._key_of(ref, "json")
        data = self._backend.read_bytes(key)
        check_sha256(ref.uri, ref.sha256, piecewise_sha256(data))
        return json.loads(data.decode("utf-8"))

    def find_json(self, key: str) -> Any | None:
        """The JSON value at ``key``, or None when nothing is there (no digest to check it against:
        for small records whose key is their identity, such as the scheduled series' runs)."""
        validate_key(key)
        if not self._backend.exists(key):
            return None
        return json.loads(self._backend.read_bytes(key).decode("utf-8"))

    @contextmanager
    def _refused_writes(self, key: str) -> Iterator[None]:
        """A filesystem's refusal (full, read-only, no permission) as a `StoreWriteError` naming the
        object and the fix; the write has already removed what it had written."""
        try:
            yield
        except OSError as error:
            if error.errno not in REFUSED_WRITES:
                raise
            raise StoreWriteError(
                f"the store refused to write {self._backend.uri_of(key)} ({REFUSED_WRITES[error.errno]}: "
                f"{error.strerror}); nothing of it was kept. Free space or fix the folder's permissions, "
                "or give another --store (DMD2_STORE)") from error

    def _new_ref(self, key: str, digest: str, nbytes: int, kind: str) -> ArtifactRef:
        ref = ArtifactRef(self._backend.uri_of(key), digest, nbytes, kind)
        logger.debug("stored %s (%d bytes)", ref.uri, ref.nbytes)
        return ref

    # -- small mutable objects: conditional writes ----------------------------------------------

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` at ``key`` only if no object is there, atomically: of many concurrent
        creators exactly one gets the object's version (an opaque str); the others get None.

        For small control objects that change by compare-and-swap (``infra.store.lease``), not
        for artifacts: there is no ref, and a version is what ``replace_if`` and ``delete_if``
        take. ``file://`` needs a working ``flock`` for those two (see ``infra.store.local``).
        """
        return self._backend.create_if_absent(validate_key(key), bytes(data))

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, version) of the object at ``key``, read together; None if there is none."""
        return self._backend.read_versioned(validate_key(key))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Compare-and-swap: replace the object at ``key`` with ``data`` only if it is still at
        ``version``; the new version, or None if it changed or is gone (nothing written)."""
        return self._backend.replace_if(validate_key(key), bytes(data), version)

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object at ``key`` only if it is still at ``version``; True if deleted."""
        return self._backend.delete_if(validate_key(key), version)

    # -- directories ---------------------------------------------------------------------------

    def put_dir(
        self,
        key: str,
        local_dir: str | os.PathLike,
        on_file: Callable[[str, int], None] | None = None,
    ) -> ArtifactRef:
        """Store every file below ``local_dir`` at ``key``, with a manifest written last.

        The directory becomes visible (to ``get_dir``, ``list_checkpoints``,
        ``latest_checkpoint``) only when the manifest lands; if anything fails, what was written
        is removed and nothing becomes visible. ``on_file(rel_path, nbytes)`` is called after
        each file is stored (progress reporting). A complete directory already at ``key`` is
        never replaced: identical contents return its ref (so a retried task succeeds),
        different contents raise ``ArtifactExistsError``.
        """
        validate_key(key)
        files = list_local_files(Path(local_dir))
        existing = self.find_dir(key)
        if existing is not None:
            return self._same_dir_or_raise(existing, files)
        with self._refused_writes(key):
            writer = self._backend.begin_dir(key)
            try:
                entries = []
                for rel_path, path in files:
                    digest, nbytes = writer.write_file(rel_path, str(path))
                    entries.append(ManifestEntry(rel_path, nbytes, digest))
                    if on_file is not None:
                        on_file(rel_path, nbytes)
                manifest = store_keys.encode_manifest(entries)
                writer.commit(manifest)
            except BaseException:
                writer.abort()
                raise
        ref = self._new_ref(key, piecewise_sha256(manifest), _total(entries), "dir")
        logger.debug("stored directory %s (%d files, %d bytes)", ref.uri, len(entries), ref.nbytes)
        return ref

    def get_dir(self, ref: ArtifactRef, local_dir: str | os.PathLike) -> Path:
        """Download the directory of ``ref`` into ``local_dir`` (absent or empty); return its path.

        The manifest is checked against ``ref.sha256`` and every file against the manifest
        (``IntegrityError`` naming the file's URI). Files land in a hidden staging folder that is
        renamed to ``local_dir`` only once all are verified, so a failure leaves no partial copy.
        """
        key = self._key_of(ref, "dir")
        entries = self._read_manifest(key, ref.sha256)
        dest = Path(local_dir).absolute()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FileExistsError(f"{dest} exists and is not an empty folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(hidden_sibling(str(dest), "partial"))
        try:
            for entry in entries:
                self._fetch_verified(f"{key}/{entry.path}", entry, staging)
            os.rename(staging, dest)  # replaces an empty folder, atomically
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest

    def _fetch_verified(self, key: str, entry: ManifestEntry, staging: Path) -> None:
        target = staging.joinpath(*entry.path.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, nbytes = self._backend.read_file_to(key, str(target))
        detail = "" if nbytes == entry.nbytes else f"expected {entry.nbytes} bytes, got {nbytes}"
        check_sha256(self._backend.uri_of(key), entry.sha256, digest, detail)

    def _read_manifest(self, key: str, expected_sha256: str) -> list[ManifestEntry]:
        manifest_key = f"{key}/{MANIFEST_NAME}"
        data = self._backend.read_bytes(manifest_key)
        uri = self._backend.uri_of(manifest_key)
        check_sha256(uri, expected_sha256, piecewise_sha256(data), "directory manifest")
        return store_keys.decode_manifest(data, uri)

    def find_dir(self, key: str) -> ArtifactRef | None:
        """The ref of the complete directory at ``key``; None without a readable manifest (absent, or
        a write that never finished)."""
        validate_key(key)
        manifest_key = f"{key}/{MANIFEST_NAME}"
        if not self._backend.exists(manifest_key):
            return None
        data = self._backend.read_bytes(manifest_key)
        uri = self._backend.uri_of(manifest_key)
        try:
            entries = store_keys.decode_manifest(data, uri)
        except ValueError as exc:
            logger.warning("ignoring %s: %s", uri, exc)
            return None
        return ArtifactRef(self._backend.uri_of(key), piecewise_sha256(data), _total(entries), "dir")

    def discard_dir(self, key: str) -> None:
        """Delete the directory at ``key`` (complete or not): its manifest first, so readers stop
        seeing it at once, then its files. Nothing there is not an error."""
        validate_key(key)
        self._backend.delete_tree(f"{key}/{MANIFEST_NAME}")
        self._backend.delete_tree(key)

    def _same_dir_or_raise(
        self, existing: ArtifactRef, files: list[tuple[str, Path]]
    ) -> ArtifactRef:
        # Only reached when a key is stored again, so hashing the local files twice is rare.
        entries = []
        for rel_path, path in files:
            digest, nbytes = file_digest(path)
            entries.append(ManifestEntry(rel_path, nbytes, digest))
        if piecewise_sha256(store_keys.encode_manifest(entries)) == existing.sha256:
            logger.info("directory %s already stored with identical contents", existing.uri)
            return existing
        raise ArtifactExistsError(
            f"{existing.uri} already holds a different complete directory; "
            "stored directories are immutable, write to a new key"
        )

    # -- checkpoints and retention -------------------------------------------------------------

    def checkpoint_ref(self, run_id: str, step: int) -> ArtifactRef:
        """The ref of the complete checkpoint of ``step`` (``FileNotFoundError`` if none)."""
        key = store_keys.checkpoint_key(run_id, step)
        ref = self.find_dir(key)
        if ref is None:
            raise FileNotFoundError(f"no complete checkpoint at {self._backend.uri_of(key)}")
        return ref

    def discard_checkpoint(self, run_id: str, step: int) -> None:
        """Make the checkpoint of ``step`` invisible and delete it (a damaged one: see `discard_dir`)."""
        self.discard_dir(store_keys.checkpoint_key(run_id, step))

    def list_checkpoints(self, run_id: str) -> list[int]:
        """Steps of the run's complete checkpoints (those with a manifest), ascending."""
        prefix = store_keys.checkpoints_prefix(run_id)
        return [
            step
            for step in self._numbered_dirs(prefix, store_keys.parse_step_dir)
            if self._backend.exists(f"{prefix}/{step}/{MANIFEST_NAME}")
        ]

    def latest_checkpoint(self, run_id: str) -> Checkpoint | None:
        """The run's newest complete checkpoint, or None. Folders without a manifest (a write
        that never finished) or with an unreadable one are skipped."""
        prefix = store_keys.checkpoints_prefix(run_id)
        for step in reversed(self._numbered_dirs(prefix, store_keys.parse_step_dir)):
            ref = self.find_dir(f"{prefix}/{step}")
            if ref is not None:
                return Checkpoint(step, ref)
        return None

    def list_rollouts(self, run_id: str) -> list[int]:
        """Numbers of the run's ``rollout-<n>`` folders, ascending."""
        return self._numbered_dirs(validate_name(run_id, "run id"), store_keys.parse_rollout_dir)

    def prune(self, run_id: str, keep_last: int) -> list[int]:
        """Delete the run's rollout folders except the ``keep_last`` newest; return the deleted
        rollout numbers. Checkpoints, and anything else under the run, are never touched, except
        what killed writers left (hidden staging unchanged for ``STALE_STAGING_S``; on
        ``file://`` only, where a checkpoint cut short by a preemption would otherwise keep its
        partial copy forever)."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {keep_last!r}")
        rollouts = self.list_rollouts(run_id)
        doomed = rollouts[: len(rollouts) - keep_last]
        for rollout in doomed:
            self._backend.delete_tree(store_keys.rollout_prefix(run_id, rollout))
        if doomed:
            logger.debug("pruned %d rollouts of run %s (kept %d)", len(doomed), run_id, keep_last)
        for path in self._backend.delete_stale_staging(run_id, STALE_STAGING_S):
            logger.warning("deleted %s, left by a writer that died", path)
        return doomed

    def _numbered_dirs(self, prefix: str, parse: Callable[[str], int | None]) -> list[int]:
        numbers = (parse(name) for name in self._backend.list_dirs(prefix))
        return sorted(n for n in numbers if n is not None)

    def _key_of(self, ref: ArtifactRef, kind: str) -> str:
        """The key of ``ref`` in this store; refuses other kinds and URIs outside the root."""
        if not isinstance(ref, ArtifactRef):
            raise TypeError(f"expected an ArtifactRef, got {type(ref).__name__}")
        if ref.kind != kind:
            raise ValueError(f"{ref.uri} is a {ref.kind!r} artifact, not {kind!r}")
        root = self.root_uri + "/"
        if not ref.uri.startswith(root):
            raise ValueError(f"{store_keys.shown(ref.uri)} is not under this store's root {root}")
        return validate_key(ref.uri[len(root) :])


def _total(entries: list[ManifestEntry]) -> int:
    return sum(entry.nbytes for entry in entries)

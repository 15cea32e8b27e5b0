"""`ArtifactStore`: put and get verified tensors, JSON and directories; list, find, prune and quarantine."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from infra.store import keys as store_keys
from infra.store.faults import ArtifactExistsError, IntegrityError, StoreError
from infra.store.io import (absent_is_none, file_chunks, file_sha256, hidden_sibling, legacy_sha256, list_local_files,
                            sha256_hex, verify)
from infra.store.keys import (CHECKPOINTS_DIR, MANIFEST_NAME, QUARANTINE_DIR, STEP_DIR, ArtifactRef, Checkpoint,
                              ManifestEntry, checked_int, number_in, validate_key, validate_name)
from infra.store.local import LocalBackend
from infra.store.s3 import S3Backend

logger = logging.getLogger(__name__)
RETRY_MODES = ("standard", "adaptive")
# A write's staging untouched this long belongs to a writer that died (a live one keeps writing).
STALE_STAGING_S = 3600.0


def open_backend(root_uri: str, retry_mode: str, max_attempts: int) -> LocalBackend | S3Backend:
    """The backend for ``root_uri``: a folder (``file://...`` or a bare path) or ``s3://...``. A URI that embeds
    credentials is refused, not stripped (a stripped one would quietly use the AWS settings), and never echoed."""
    if not isinstance(root_uri, str) or not root_uri:
        raise ValueError("the store root must be a non-empty URI, e.g. file:///data/artifacts")
    scheme, separator, rest = root_uri.partition("://")
    if not separator:
        return LocalBackend(root_uri)
    authority, _, path = rest.partition("/")
    if "@" in authority:
        raise ValueError("the store URI must not embed credentials (user info before the bucket or host): for S3 "
                         "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the environment instead")
    if scheme == "file":
        return LocalBackend(rest)
    if scheme in ("s3", "s3a"):
        prefix = path.strip("/")
        return S3Backend(authority, validate_key(prefix) if prefix else "", retry_mode, max_attempts)
    raise ValueError(f"unsupported store scheme {scheme[:16]!r}: use file://<folder> or s3://<bucket>/<prefix>")


class ArtifactStore:
    """Put and get verified artifacts below ``root_uri`` (``file://``, a bare path, or ``s3://``).

    On S3, botocore retries each request in ``retry_mode`` (``adaptive`` also slows down when S3 throttles),
    ``max_attempts`` in all, waiting rand(0, 1) * min(2**k, 20) s before the k-th retry: the default 8 give up
    on an endpoint down for good after about 35 s (70 s at most). Pickles as its root URI and retry settings.
    """

    rollout_key = staticmethod(store_keys.rollout_key)
    checkpoint_key = staticmethod(store_keys.checkpoint_key)

    def __init__(self, root_uri: str, retry_mode: str = "standard", max_attempts: int = 8):
        if retry_mode not in RETRY_MODES:
            raise ValueError(f"retry_mode must be one of {RETRY_MODES} (botocore's), got {retry_mode!r}")
        self.retry_mode = retry_mode
        self.max_attempts = checked_int(max_attempts, "max_attempts", minimum=1)  # the first attempt counts
        self._backend = open_backend(root_uri, retry_mode, max_attempts)
        # The canonical root: file:///abs/folder or s3://bucket[/prefix], no trailing /.
        self.root_uri = self._backend.root_uri

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root_uri!r})"

    def __reduce__(self) -> tuple:
        return type(self), (self.root_uri, self.retry_mode, self.max_attempts)

    def uri(self, key: str) -> str:
        return self._backend.uri_of(validate_key(key))

    @contextmanager
    def _faults(self, key: str, writing: bool = False) -> Iterator[None]:
        """What the backend still raises, as the store error that names the URI and the fix (if any)."""
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:
            error = self._backend.translate(exc, self._backend.uri_of(key), writing)
            if error is None:
                raise
            raise error from exc

    # -- tensors and JSON ----------------------------------------------------------------------

    def put_tensors(self, key: str, tensors: Mapping[str, torch.Tensor], durable: bool = True) -> ArtifactRef:
        """Store tensors (contiguous, no shared memory) as one safetensors object at ``key``, replacing it
        atomically. ``durable=False`` (for objects made again after a machine crash) skips file://'s fsyncs."""
        validate_key(key)
        return self._put(key, _safetensors_bytes(key, tensors), "tensors", durable)

    def get_tensors(self, ref: ArtifactRef) -> dict[str, torch.Tensor]:
        """The tensors of ``ref`` in private CPU memory, parsed from the very bytes whose sha256 was checked."""
        try:
            return safetensors.torch.load(self._get(ref, "tensors"))
        except SafetensorError as exc:
            raise ValueError(f"{ref.uri} is not a safetensors file: {exc}") from exc

    def put_json(self, key: str, obj: Any) -> ArtifactRef:
        """Store ``obj`` as JSON at ``key`` (sorted keys; NaN/Infinity as Python's json writes)."""
        return self._put(validate_key(key), json.dumps(obj, sort_keys=True).encode("utf-8"), "json")

    def get_json(self, ref: ArtifactRef) -> Any:
        return json.loads(self._get(ref, "json").decode("utf-8"))

    def find_json(self, key: str) -> Any | None:
        """The JSON value at ``key``, or None; unverified (no ref), for small records whose key is their identity."""
        data = self._read_if_present(validate_key(key))
        return None if data is None else json.loads(data.decode("utf-8"))

    def _put(self, key: str, data: bytes, kind: str, durable: bool = True) -> ArtifactRef:
        with self._faults(key, writing=True):
            digest, nbytes = self._backend.write(self._backend.path(key), [data], durable)
        return ArtifactRef(self._backend.uri_of(key), digest, nbytes, kind)

    def _get(self, ref: ArtifactRef, kind: str) -> bytes:
        return self._read_verified(self._key_of(ref, kind), ref.sha256, ref.nbytes)

    def _read_verified(self, key: str, sha256: str, nbytes: int | None = None, detail: str = "") -> bytes:
        """The bytes at ``key``; ``IntegrityError`` unless they have the ``sha256`` (and size) they were stored with."""
        with self._faults(key):
            data = self._backend.read_bytes(key)
        if nbytes is not None and len(data) != nbytes:
            detail = f"expected {nbytes} bytes, found {len(data)}"
        verify(self._backend.uri_of(key), sha256, sha256_hex(data), lambda: legacy_sha256(data), detail)
        return data

    def _read_if_present(self, key: str) -> bytes | None:
        with self._faults(key):
            return absent_is_none(lambda: self._backend.read_bytes(key))

    # -- small mutable objects (the lease): conditional writes; a version is an opaque str -------

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` at ``key`` if no object is there: of concurrent creators one gets a version, others None."""
        with self._faults(key, writing=True):
            return self._backend.create_if_absent(validate_key(key), bytes(data))

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, version) of the object at ``key``, read together; None if there is none."""
        with self._faults(key):
            return self._backend.read_versioned(validate_key(key))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Replace the object at ``key`` only if it is still at ``version``; the new version, or None."""
        with self._faults(key, writing=True):
            return self._backend.replace_if(validate_key(key), bytes(data), version)

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object at ``key`` only if it is still at ``version``; True if deleted."""
        with self._faults(key, writing=True):
            return self._backend.delete_if(validate_key(key), version)

    # -- directories ---------------------------------------------------------------------------

    def put_dir(self, key: str, local_dir: str | os.PathLike,
                on_file: Callable[[str, int], None] | None = None) -> ArtifactRef:
        """Store every file below ``local_dir`` at ``key``, calling ``on_file(rel_path, nbytes)`` after each.
        A complete directory is never replaced: identical contents return its ref (a retried task succeeds),
        others raise ``ArtifactExistsError``."""
        validate_key(key)
        files = list_local_files(Path(local_dir))
        if (existing := self.find_dir(key)) is not None:
            return self._same_dir_or_raise(existing, files)
        backend = self._backend
        with self._faults(key, writing=True):
            staging = backend.staging_dir(key)
            try:
                entries = []
                for rel_path, path in files:
                    digest, nbytes = backend.write(f"{staging}/{rel_path}", file_chunks(path))
                    entries.append(ManifestEntry(rel_path, nbytes, digest))
                    if on_file is not None:
                        on_file(rel_path, nbytes)
                manifest = store_keys.encode_manifest(entries)
                backend.write(f"{staging}/{MANIFEST_NAME}", [manifest])  # last: it makes the directory visible
                backend.publish_dir(key, staging)
            except BaseException:
                backend.discard_staging(staging)
                raise
        return ArtifactRef(backend.uri_of(key), sha256_hex(manifest), sum(e.nbytes for e in entries), "dir")

    def get_dir(self, ref: ArtifactRef, local_dir: str | os.PathLike, paths: Iterable[str] | None = None) -> Path:
        """Download the directory of ``ref`` (or only its files ``paths``) into ``local_dir`` (absent or empty),
        verified in a hidden folder renamed to it at the end: a failure leaves no partial copy."""
        key = self._key_of(ref, "dir")
        entries = self._read_manifest(key, ref.sha256)
        if paths is not None:
            wanted = set(paths)
            entries = [entry for entry in entries if entry.path in wanted]
            if len(entries) != len(wanted):
                raise FileNotFoundError(f"{ref.uri} lacks {sorted(wanted - {e.path for e in entries})}")
        dest = Path(local_dir).absolute()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FileExistsError(f"{dest} exists and is not an empty folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(hidden_sibling(str(dest), "partial"))
        try:
            staging.mkdir()
            for entry in entries:
                self._fetch(f"{key}/{entry.path}", entry, staging.joinpath(*entry.path.split("/")))
            os.rename(staging, dest)  # replaces an empty folder, atomically
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest

    def _fetch(self, key: str, entry: ManifestEntry, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._faults(key):
            digest, nbytes = self._backend.read_to(key, str(target))
        detail = "" if nbytes == entry.nbytes else f"expected {entry.nbytes} bytes, got {nbytes}"
        verify(self._backend.uri_of(key), entry.sha256, digest, lambda: file_sha256(target, legacy=True), detail)

    def list_dir(self, ref: ArtifactRef) -> list[str]:
        """The relative paths of the files of the directory ``ref``, from its verified manifest."""
        return [entry.path for entry in self._read_manifest(self._key_of(ref, "dir"), ref.sha256)]

    def _read_manifest(self, key: str, sha256: str) -> list[ManifestEntry]:
        manifest_key = f"{key}/{MANIFEST_NAME}"
        data = self._read_verified(manifest_key, sha256, detail="directory manifest")
        return store_keys.decode_manifest(data, self._backend.uri_of(manifest_key))

    def find_dir(self, key: str) -> ArtifactRef | None:
        """The ref of the complete directory at ``key``; None without a readable manifest (or any)."""
        manifest_key = f"{validate_key(key)}/{MANIFEST_NAME}"
        if (data := self._read_if_present(manifest_key)) is None:
            return None
        try:
            entries = store_keys.decode_manifest(data, self._backend.uri_of(manifest_key))
        except ValueError as exc:
            logger.warning("ignoring %s", exc)
            return None
        return ArtifactRef(self._backend.uri_of(key), sha256_hex(data), sum(e.nbytes for e in entries), "dir")

    def discard_dir(self, key: str) -> None:
        """Delete the directory at ``key``, complete or not (nothing there is not an error)."""
        with self._faults(validate_key(key), writing=True):
            self._backend.delete_dir(key)

    def _same_dir_or_raise(self, existing: ArtifactRef, files: list[tuple[str, Path]]) -> ArtifactRef:
        # Only reached when a key is stored again, so hashing the local files once more is rare.
        stored = {e.path: e.sha256 for e in self._read_manifest(self._key_of(existing, "dir"), existing.sha256)}
        if sorted(stored) == [rel_path for rel_path, _ in files] and all(
                stored[rel_path] in (file_sha256(path), file_sha256(path, legacy=True)) for rel_path, path in files):
            logger.info("directory %s already stored with identical contents", existing.uri)
            return existing
        raise ArtifactExistsError(f"{existing.uri} already holds a different complete directory; stored "
                                  "directories are immutable, write to a new key")

    # -- checkpoints and retention -------------------------------------------------------------

    def checkpoint_ref(self, run_id: str, step: int) -> ArtifactRef:
        """The ref of the complete checkpoint of ``step`` (``FileNotFoundError`` if none)."""
        key = store_keys.checkpoint_key(run_id, step)
        if (ref := self.find_dir(key)) is None:
            raise FileNotFoundError(f"no complete checkpoint at {self._backend.uri_of(key)}")
        return ref

    def list_checkpoints(self, run_id: str) -> list[int]:
        """Steps of the run's complete checkpoints (those with a manifest), ascending."""
        prefix = f"{validate_name(run_id, 'run id')}/{CHECKPOINTS_DIR}"
        return [step for step in self._numbered_dirs(prefix, STEP_DIR)
                if self._read_if_present(f"{prefix}/{step}/{MANIFEST_NAME}") is not None]

    def latest_checkpoint(self, run_id: str) -> Checkpoint | None:
        """The run's newest complete checkpoint (with a readable manifest), or None."""
        prefix = f"{validate_name(run_id, 'run id')}/{CHECKPOINTS_DIR}"
        for step in reversed(self._numbered_dirs(prefix, STEP_DIR)):
            if (ref := self.find_dir(f"{prefix}/{step}")) is not None:
                return Checkpoint(step, ref)
        return None

    def resume_checkpoint(self, run_id: str, load: Callable[[ArtifactRef], object],
                          on_damaged: Callable[[int, Exception, str], None] | None = None) -> int:
        """Load the run's newest sound checkpoint with ``load(ref)``; return its step (0: there is none). One that
        fails its checksum or misses a file is read once more (a torn read is not damage), then quarantined,
        reported with ``on_damaged(step, error, quarantine URI)`` (default: a warning), and the one before tried.
        Any other error propagates: a fault of the moment (the store down) never condemns a checkpoint."""
        while (latest := self.latest_checkpoint(run_id)) is not None:
            for _ in range(2):
                try:
                    load(latest.ref)
                    return latest.step
                except (IntegrityError, FileNotFoundError) as exc:
                    error = exc
            where = self.quarantine_checkpoint(run_id, latest.step)
            if on_damaged is None:
                logger.warning("the checkpoint %s is damaged (%s); moved to %s", latest.ref.uri, error, where)
            else:
                on_damaged(latest.step, error, where)
        return 0

    def quarantine_checkpoint(self, run_id: str, step: int) -> str:
        """Move every folder of the checkpoint of ``step`` (each group's ``<step>`` and ``<step>-rank-<r>``) to
        ``<run_id>/quarantine/<step>-<UTC time>/<folder>/<name>``, kept but no longer a checkpoint; its URI."""
        run_id = validate_name(run_id, "run id")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        target = f"{run_id}/{QUARANTINE_DIR}/{int(step)}-{stamp}"
        with self._faults(target, writing=True):
            for folder in self._backend.list_dirs(run_id):
                if folder == CHECKPOINTS_DIR or folder.startswith(f"{CHECKPOINTS_DIR}_"):
                    for name in self._backend.list_dirs(f"{run_id}/{folder}"):
                        if number_in(name, store_keys.STEP_OR_PART_DIR) == step:
                            self._backend.move_tree(f"{run_id}/{folder}/{name}", f"{target}/{folder}/{name}")
        return self._backend.uri_of(target)

    def list_rollouts(self, run_id: str) -> list[int]:
        """Numbers of the run's ``rollout-<n>`` folders, ascending."""
        return self._numbered_dirs(validate_name(run_id, "run id"), store_keys.ROLLOUT_DIR)

    def prune(self, run_id: str, keep_last: int) -> list[int]:
        """Delete the run's rollout folders but the ``keep_last`` newest, and what killed writers left (file://
        staging unchanged for an hour); return the rollouts' numbers. Nothing else under the run is touched."""
        checked_int(keep_last, "keep_last")
        rollouts = self.list_rollouts(run_id)
        doomed = rollouts[: len(rollouts) - keep_last]
        with self._faults(run_id, writing=True):
            for rollout in doomed:
                self._backend.delete_tree(store_keys.rollout_prefix(run_id, rollout))
            for path in self._backend.delete_stale_staging(run_id, STALE_STAGING_S):
                logger.warning("deleted %s, left by a writer that died", path)
        return doomed

    def _numbered_dirs(self, prefix: str, pattern) -> list[int]:
        with self._faults(prefix):
            numbers = (number_in(name, pattern) for name in self._backend.list_dirs(prefix))
            return sorted(n for n in numbers if n is not None)

    def _key_of(self, ref: ArtifactRef, kind: str) -> str:
        """The key of ``ref`` in this store; refuses other kinds and URIs outside the root."""
        if not isinstance(ref, ArtifactRef):
            raise TypeError(f"expected an ArtifactRef, got {type(ref).__name__}")
        if ref.kind != kind:
            raise ValueError(f"{ref.uri} is a {ref.kind!r} artifact, not {kind!r}")
        if not ref.uri.startswith(self.root_uri + "/"):
            raise ValueError(f"{store_keys.shown(ref.uri)} is not under this store's root {self.root_uri}/")
        return validate_key(ref.uri[len(self.root_uri) + 1:])


def _safetensors_bytes(key: str, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """``safetensors.torch.save``'s file of ``tensors``; its refusals as ``ValueError`` naming the key."""
    if "__metadata__" in tensors:  # the format's reserved name: the file would not load again
        raise ValueError(f"{key}: '__metadata__' is reserved by safetensors; rename that tensor")
    try:
        return safetensors.torch.save(dict(tensors))
    except KeyError as exc:  # safetensors' table of dtypes lacks it
        raise ValueError(f"{key}: safetensors does not write dtype {exc.args[0]}") from exc
    except RuntimeError as exc:
        if "share memory" not in str(exc):
            raise
        raise ValueError(f"{key}: {' '.join(str(exc).split())} Store a .clone() of one.") from exc

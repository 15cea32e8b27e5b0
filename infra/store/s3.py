"""The ``s3://`` backend of the artifact store, on s3fs.

Atomicity: S3 makes an object visible only when its PUT (or multipart upload) completes, so each
object is written in one upload; a directory becomes visible when its manifest, uploaded last,
appears. Endpoint, region and credentials come from botocore's own resolution (AWS_ENDPOINT_URL,
AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/...); this
module never reads, keeps or prints a credential.

Retries: s3fs and botocore each retry on their own; both are turned down to one attempt so that
``RetryPolicy`` is the single, configurable bound, and every operation is retried whole.

Conditional writes (the run lease, ``infra.store.lease``) are S3's own (AWS since 2024; any
S3 API that honours the headers): PutObject with ``If-None-Match: *`` creates only if absent,
PutObject and DeleteObject with ``If-Match: <etag>`` only touch the version that was read. They go
through the botocore client s3fs holds, since s3fs's file API does not pass the conditions. A
failed condition (412 PreconditionFailed, 409 ConditionalRequestConflict, or 404 for If-Match on a
deleted object) is an answer, not an error: it is never retried. An object's version is its ETag.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import s3fs
from fsspec.asyn import sync

from infra.store import tensors as store_tensors
from infra.store.faults import (
    CREDENTIAL_SETTINGS,
    ENDPOINT_SETTINGS,
    Fault,
    RetryPolicy,
    StoreAccessError,
    StoreNotFoundError,
    StoreUnavailableError,
    call_with_retries,
    classify,
    client_error_code,
    describe,
)
from infra.store.io import copy_hashing, digest_while, copy_to_file_hashing, write_hashing
from infra.store.keys import MANIFEST_NAME

logger = logging.getLogger(__name__)
T = TypeVar("T")

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Multipart parts must be >= 5 MiB; larger blocks mean fewer requests for big checkpoint files.
_UPLOAD_BLOCK_BYTES = 64 * 2**20
# Each parallel ranged GET of a download: large enough that requests are few, small enough that
# every hashing thread gets a share of a rollout's artifacts.
_DOWNLOAD_SPAN_BYTES = 8 * 2**20
# What S3 answers when a conditional request's condition does not hold (or lost a race to one
# that did): the object exists, changed, or is gone.
_CONDITION_FAILED_CODES = frozenset(
    {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}
)


def validate_bucket(bucket: str) -> str:
    """Return ``bucket`` if it is a valid S3 bucket name, else raise ``ValueError``."""
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(f"invalid S3 bucket name {bucket[:64]!r}: 3-63 of [a-z0-9.-]")
    return bucket


def _make_filesystem() -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(
        # A private instance: fsspec's cache would hand back a client built with older settings.
        skip_instance_cache=True,
        # Other processes write checkpoints; a cached listing would hide them.
        use_listings_cache=False,
        config_kwargs={"retries": {"total_max_attempts": 1}},
    )
    fs.retries = 1
    return fs


class S3Backend:
    """Objects live under ``s3://<bucket>/<prefix>/``; keys are already validated by the store."""

    def __init__(self, bucket: str, prefix: str, retry: RetryPolicy):
        self.bucket = validate_bucket(bucket)
        self.prefix = prefix
        self.root_uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.retry = retry
        self._fs = _make_filesystem()

    def __repr__(self) -> str:
        return f"S3Backend({self.root_uri!r})"

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{self._object_key(key)}"

    def _object_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_of(self, key: str) -> str:
        """The URI of a key."""
        return f"{self.root_uri}/{key}"

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one S3 operation under the retry policy and translate what it finally raises."""
        uri = self.uri_of(key)
        try:
            return call_with_retries(fn, self.retry, f"{what} {uri}")
        except Exception as exc:
            translated = self._translate(exc, uri, reading=what == "get")
            if translated is None:
                raise
            raise translated from exc

    def _translate(self, exc: Exception, uri: str, reading: bool) -> Exception | None:
        """A clear store error for a fault that the caller can act on, or None to re-raise.

        Messages name the settings to check, never their values; the service's own message is
        left to the exception chain, since S3 echoes no secret (it never receives one).
        """
        fault = classify(exc)
        if fault is Fault.CREDENTIALS:
            return StoreAccessError(
                f"the object store at {self._endpoint()} refused access to {uri} "
                f"({describe(exc)}). Check the credentials: {CREDENTIAL_SETTINGS}; that they "
                f"may use bucket '{self.bucket}'; and the endpoint: {ENDPOINT_SETTINGS}."
            )
        if fault is Fault.MISSING_BUCKET:
            return StoreNotFoundError(
                f"bucket '{self.bucket}' does not exist at {self._endpoint()} (needed for "
                f"{uri}). Create it, or check the store URI, {ENDPOINT_SETTINGS} and AWS_PROFILE."
            )
        if fault is Fault.TRANSIENT:
            return StoreUnavailableError(
                f"the object store at {self._endpoint()} kept failing for {uri} "
                f"({describe(exc)}, {self.retry.max_attempts} attempts). Check that it is "
                f"reachable and {ENDPOINT_SETTINGS}."
            )
        if reading and isinstance(exc, FileNotFoundError):
            return FileNotFoundError(f"no object at {uri}")
        return None

    def _endpoint(self) -> str:
        """scheme://host[:port] of the endpoint in use; userinfo and path are dropped."""
        try:
            parts = urlsplit(self._fs.s3.meta.endpoint_url)
            port = f":{parts.port}" if parts.port else ""
            return f"{parts.scheme}://{parts.hostname}{port}"
        except Exception:  # describing the endpoint must never mask the real error
            return "the configured endpoint"

    def write_bytes(self, key: str, data: bytes) -> str:
        """Store ``data`` in one upload (visible only once complete); return its digest."""
        path = self._path(key)

        def upload() -> None:
            self._call("put", key, lambda: self._fs.pipe_file(path, data))

        return digest_while(data, upload)

    # -- conditional writes of small objects ---------------------------------------------------

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` at ``key`` only if nothing is there (``If-None-Match: *``); its ETag,
        or None if something was."""
        return self._put_if(key, data, IfNoneMatch="*")

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        """Replace the object at ``key`` if its ETag is still ``version`` (``If-Match``); the new
        ETag, or None if it changed or is gone."""
        return self._put_if(key, data, IfMatch=version)

    def _put_if(self, key: str, data: bytes, **condition: str) -> str | None:
        def put() -> str | None:
            try:
                response = self._fs.call_s3(
                    "put_object", Bucket=self.bucket, Key=self._object_key(key), Body=data,
                    **condition,
                )
            except Exception as exc:
                if _condition_failed(exc):
                    return None
                raise
            return response["ETag"]

        return self._call("put", key, put)

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of the object at ``key``, from one GET; None if there is none."""
        return self._call("get", key, lambda: sync(self._fs.loop, self._get_versioned, key))

    async def _get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            response = await self._fs._call_s3(
                "get_object", Bucket=self.bucket, Key=self._object_key(key)
            )
        except FileNotFoundError as exc:
            if classify(exc) is Fault.MISSING_BUCKET:
                raise
            return None
        try:
            return await response["Body"].read(), response["ETag"]
        finally:
            response["Body"].close()

    def delete_if(self, key: str, version: str) -> bool:
        """Delete the object at ``key`` if its ETag is still ``version``; True if it was."""

        def delete() -> bool:
            try:
                self._fs.call_s3(
                    "delete_object", Bucket=self.bucket, Key=self._object_key(key), IfMatch=version
                )
            except Exception as exc:
                if _condition_failed(exc):
                    return False
                raise
            return True

        return self._call("delete", key, delete)

    def write_tensors(self, key: str, tensors: dict, durable: bool = True) -> tuple[str, int]:
        """Store ``tensors`` as one safetensors object at ``key``; return (digest, size). A completed
        S3 put is durable either way.

        The file is streamed from the tensors' own memory (``store_tensors.serialize``) in
        multipart blocks, hashed meanwhile: no serialised copy of a large export is ever made.
        """
        buffers = store_tensors.serialize(tensors)

        def stream(upload: s3fs.core.S3File) -> str:
            return write_hashing(buffers, upload)

        digest = self._call("put", key, lambda: self._upload(self._path(key), stream))
        return digest, sum(len(buffer) for buffer in buffers)

    def read_bytes(self, key: str) -> bytes:
        """The bytes of the object at ``key`` (``FileNotFoundError`` if absent)."""
        path = self._path(key)
        return self._call("get", key, lambda: self._fs.cat_file(path))

    def load_tensors(self, key: str, uri: str, sha256: str, nbytes: int, device: str) -> dict:
        """Download the safetensors object at ``key`` and return its tensors once the digest
        matched (``store_tensors.read_verified``).

        Ranges of the object are fetched in parallel, straight into the tensors' buffer, and
        hashed by the thread that fetched them: one stream is slow on S3, and no second copy of
        the object is held.
        """
        path = self._path(key)
        return self._call("get", key, lambda: self._load_once(path, uri, sha256, nbytes, device))

    def _load_once(self, path: str, uri: str, sha256: str, nbytes: int, device: str) -> dict:
        size, read_at = self._ranged_reader(path)
        span = _DOWNLOAD_SPAN_BYTES
        return store_tensors.read_verified(size, read_at, uri, sha256, nbytes, device, span)

    def _ranged_reader(self, path: str) -> tuple[int, Callable[[memoryview, int], int]]:
        """The object's size, and a ``read_at`` that fetches a range of it with one GET."""

        def read_at(region: memoryview, offset: int) -> int:
            data = self._fs.cat_file(path, start=offset, end=offset + len(region))
            region[: len(data)] = data
            return len(data)

        return self._fs.info(path)["size"], read_at

    def write_file_from(self, key: str, local_path: str) -> tuple[str, int]:
        """Upload a local file, hashing it as it streams; return (digest, size) of what was sent."""

        def copy(upload: s3fs.core.S3File) -> tuple[str, int]:
            with open(local_path, "rb") as src:
                return copy_hashing(src, upload)

        return self._call("put", key, lambda: self._upload(self._path(key), copy))

    def _upload(self, path: str, fill: Callable[[s3fs.core.S3File], T]) -> T:
        """One attempt at writing the object at ``path`` through ``fill(upload)``, in multipart
        blocks; the object appears when it is complete, or not at all."""
        upload = self._fs.open(path, "wb", block_size=_UPLOAD_BLOCK_BYTES)
        try:
            result = fill(upload)
            upload.close()
        except BaseException:
            _discard(upload)
            raise
        return result

    def read_file_to(self, key: str, dest: str) -> tuple[str, int]:
        """Download the object at ``key`` into the local file ``dest`` in parallel ranged GETs,
        hashed meanwhile; return (digest, size)."""
        return self._call("get", key, lambda: self._download_once(self._path(key), dest))

    def _download_once(self, path: str, dest: str) -> tuple[str, int]:
        size, read_at = self._ranged_reader(path)
        with open(dest, "wb") as out:  # "wb" (not "xb"): a retried attempt starts the file over
            return copy_to_file_hashing(out, size, read_at, _DOWNLOAD_SPAN_BYTES)

    def begin_dir(self, key: str) -> S3DirWriter:
        """Start writing a directory artifact at ``key`` (see ``S3DirWriter``)."""
        return S3DirWriter(self, key)

    def exists(self, key: str) -> bool:
        """True if an object is stored at ``key``."""
        path = self._path(key)
        return self._call("stat", key, lambda: self._is_file(path))

    def _is_file(self, path: str) -> bool:
        try:
            return self._fs.info(path)["type"] == "file"
        except FileNotFoundError as exc:
            if classify(exc) is Fault.MISSING_BUCKET:
                raise
            return False

    def list_dirs(self, key: str) -> list[str]:
        """Names of the sub-folders (common prefixes) of ``key``; none if it does not exist."""
        path = self._path(key)
        return self._call("list", key, lambda: self._list_dirs(path))

    def _list_dirs(self, path: str) -> list[str]:
        try:
            entries = self._fs.ls(path, detail=True)
        except FileNotFoundError as exc:
            if classify(exc) is Fault.MISSING_BUCKET:
                raise
            return []
        folders = (e["name"].rstrip("/") for e in entries if e["type"] == "directory")
        names = (folder.rsplit("/", 1)[-1] for folder in folders)
        return sorted(name for name in names if not name.startswith("."))

    def delete_tree(self, key: str) -> None:
        """Delete every object below ``key``; a missing key is not an error."""
        path = self._path(key)
        self._call("delete", key, lambda: self._delete_tree(path))

    def delete_stale_staging(self, key: str, max_age_s: float) -> list[str]:
        """Nothing to delete: S3 writes stage nothing under the store's keys. An interrupted
        upload never becomes an object (its parts are the bucket's to expire: a lifecycle rule
        that aborts incomplete multipart uploads), and an interrupted directory's files, invisible
        without their manifest, are replaced when the same key is written again."""
        return []

    def _delete_tree(self, path: str) -> None:
        try:
            self._fs.rm(path, recursive=True)
        except FileNotFoundError as exc:
            if classify(exc) is Fault.MISSING_BUCKET:
                raise


def _condition_failed(exc: BaseException) -> bool:
    coded = client_error_code(exc)
    return coded is not None and (coded[0] in _CONDITION_FAILED_CODES or coded[1] == 412)


def _discard(upload: s3fs.core.S3File) -> None:
    """Abandon an unfinished upload so that nothing of it becomes visible."""
    try:
        upload.discard()  # aborts a multipart upload if one was started
    except Exception as exc:  # S3 expires abandoned parts; the original error matters more
        logger.warning("could not abort the upload of %s: %s", upload.path, describe(exc))
    # discard() leaves the file open, and the finaliser of an open file would commit it.
    upload.closed = True


class S3DirWriter:
    """Uploads a directory's files to their final keys, then the manifest last.

    Readers ignore a folder without a manifest, so a writer killed midway leaves nothing visible.
    Leftovers of such a writer under the same key are deleted before a new attempt starts, so
    they can never be mistaken for part of the new directory.
    """

    def __init__(self, backend: S3Backend, key: str):
        self.backend = backend
        self.key = key
        backend.delete_tree(key)

    def write_file(self, rel_path: str, local_path: str) -> tuple[str, int]:
        """Upload one file of the directory; return (digest, size) of what was sent."""
        return self.backend.write_file_from(f"{self.key}/{rel_path}", local_path)

    def commit(self, manifest: bytes) -> None:
        """Upload the manifest: the directory becomes visible now, and not before."""
        self.backend.write_bytes(f"{self.key}/{MANIFEST_NAME}", manifest)

    def abort(self) -> None:
        """Delete what was uploaded (best effort: a failure is logged, never raised)."""
        try:
            self.backend.delete_tree(self.key)
        except Exception as exc:
            logger.warning(
                "could not clean up partial upload under %s: %s; it stays invisible without "
                "a manifest", self.backend.uri_of(self.key), describe(exc),
            )

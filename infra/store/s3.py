"""The ``s3://`` backend, on s3fs. Endpoint, region and credentials are botocore's own resolution: this module
never reads, keeps or prints a credential.

Visible only when complete: S3 shows an object once its PUT (or multipart upload) completes, so each object is one
upload; a directory's files go to their final keys and its manifest last. Retries are botocore's alone (s3fs's own
loop is set to one try, so the two never multiply); its flexible checksums guard the transport, the sha256 of
every read the bytes at rest. Conditional writes (the lease) are S3's own, through s3fs's botocore client (its file
API drops the conditions): ``If-None-Match: *`` creates only if absent, ``If-Match: <etag>`` replaces or deletes
only the version read; a failed condition is an answer, not an error. An object's version is its ETag.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from fsspec.asyn import sync
from fsspec.core import url_to_fs

from infra.store.faults import StoreError, client_error_code, describe, s3_error
from infra.store.io import Backend, absent_is_none, write_hashing

logger = logging.getLogger(__name__)
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Multipart parts must be >= 5 MiB; larger blocks mean fewer requests for big checkpoint files.
_UPLOAD_BLOCK_BYTES = 64 * 2**20
# S3's answers when a condition does not hold (the object exists, changed, or is gone), besides HTTP 412.
_CONDITION_FAILED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"})


def validate_bucket(bucket: str) -> str:
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(f"invalid S3 bucket name {bucket[:64]!r}: 3-63 of [a-z0-9.-]")
    return bucket


class S3Backend(Backend):
    def __init__(self, bucket: str, prefix: str, retry_mode: str, max_attempts: int):
        self.bucket, self.prefix, self.max_attempts = validate_bucket(bucket), prefix, max_attempts
        fs, _ = url_to_fs(
            f"s3://{bucket}",
            skip_instance_cache=True,  # fsspec's cache would hand back a client built with other settings
            use_listings_cache=False,  # other processes write checkpoints; a cached listing would hide them
            config_kwargs={"retries": {"mode": retry_mode, "total_max_attempts": max_attempts}})
        fs.retries = 1
        root = f"{bucket}/{prefix}" if prefix else bucket
        super().__init__(fs, root, f"s3://{root}")

    def translate(self, exc: BaseException, uri: str, writing: bool) -> StoreError | None:
        """What a call still raised after botocore's last attempt, as a store error (None: re-raise)."""
        return s3_error(exc, uri, self.bucket, self._endpoint(), self.max_attempts)

    def _endpoint(self) -> str:
        try:  # scheme://host[:port]: userinfo and path are dropped
            parts = urlsplit(self.fs.s3.meta.endpoint_url)
            return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        except Exception:  # describing the endpoint must never mask the real error
            return "the configured endpoint"

    def write(self, path: str, chunks: Iterable[bytes], durable: bool = True) -> tuple[str, int]:
        """Upload the concatenation of ``chunks`` to ``path`` in one upload; (sha256, size), hashed meanwhile."""
        upload = self.fs.open(path, "wb", block_size=_UPLOAD_BLOCK_BYTES)
        try:
            result = write_hashing(chunks, upload)
            upload.close()  # one PUT, or the multipart upload's completion: the object appears now
        except BaseException:
            try:
                upload.discard()  # aborts a multipart upload if one was started
            except Exception as exc:  # S3 expires abandoned parts (a lifecycle rule); the first error matters more
                logger.warning("could not abort the upload of %s: %s", upload.path, describe(exc))
            upload.closed = True  # discard() leaves it open, and the finaliser of an open file would commit it
            raise
        return result

    def staging_dir(self, key: str) -> str:
        """``key`` itself, emptied of what a killed writer left (invisible without a manifest, never mixed in)."""
        self.delete_tree(key)
        return self.path(key)

    def publish_dir(self, key: str, staging: str) -> None:
        """Nothing to do: the manifest, written last, made the directory visible."""

    def delete_stale_staging(self, key: str, max_age_s: float) -> list[str]:
        """None: an interrupted upload never becomes an object (the bucket expires its parts), and an interrupted
        directory is emptied when its key is written again."""
        return []

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        response = self._if("put_object", key, Body=data, IfNoneMatch="*")
        return None if response is None else response["ETag"]

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        response = self._if("put_object", key, Body=data, IfMatch=version)
        return None if response is None else response["ETag"]

    def delete_if(self, key: str, version: str) -> bool:
        return self._if("delete_object", key, IfMatch=version) is not None

    def _if(self, method: str, key: str, **arguments) -> dict | None:
        """S3's response to a conditional request, or None if its condition did not hold."""
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, Key=self._object_key(key), **arguments)
        except Exception as exc:
            coded = client_error_code(exc)
            if coded is not None and (coded[0] in _CONDITION_FAILED or coded[1] == 412):
                return None
            raise

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of the object at ``key``, from one GET; None if there is none."""
        return absent_is_none(lambda: sync(self.fs.loop, self._get_versioned, key))

    async def _get_versioned(self, key: str) -> tuple[bytes, str]:
        response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._object_key(key))
        try:
            return await response["Body"].read(), response["ETag"]
        finally:
            response["Body"].close()

    def _object_key(self, key: str) -> str:  # the fs's paths start with the bucket, S3's keys do not
        return f"{self.prefix}/{key}" if self.prefix else key

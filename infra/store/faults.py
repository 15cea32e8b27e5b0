"""Errors of the artifact store, and what a failure means once botocore's retries (its ``standard`` or
``adaptive`` mode, the only retrying there is) are spent: an error naming the settings to check, never their
values. Anything else propagates."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import botocore.exceptions
import botocore.parsers

from dmd2.failures import RunError

ENDPOINT_SETTINGS = "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (or endpoint_url in ~/.aws/config)"
_CREDENTIAL_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidClientTokenId",
    "InvalidToken", "RequestTimeTooSkewed", "SignatureDoesNotMatch", "UnrecognizedClientException"})
_BUSY_CODES = frozenset({"InternalError", "RequestTimeout", "ServiceUnavailable", "SlowDown", "Throttling",
                         "ThrottlingException", "TooManyRequestsException"})
# Still raised after the last attempt when the endpoint is down, cut off or overloaded; a throttled S3
# can answer with broken XML (fsspec/s3fs#484), hence the parser error.
_DOWN_TYPES = (ConnectionError, TimeoutError, botocore.exceptions.ConnectionError,
               botocore.exceptions.HTTPClientError, botocore.exceptions.IncompleteReadError,
               botocore.parsers.ResponseParserError)
_NO_CREDENTIAL_TYPES = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)
# Why a filesystem refuses a write; waiting does not cure any of them.
REFUSED_WRITES = {errno.ENOSPC: "no space left", errno.EDQUOT: "over the disk quota", errno.EROFS: "read-only",
                  errno.EACCES: "no permission", errno.EPERM: "not permitted", errno.EFBIG: "file too large"}


class StoreError(RunError):
    """Base class of the artifact store's own errors (their messages name the URI and the fix)."""


class IntegrityError(StoreError):
    """Stored bytes do not match the sha256 they were written with (corruption or tampering)."""

    def __init__(self, uri: str, expected_sha256: str, actual_sha256: str, detail: str = ""):
        self.uri, self.expected_sha256, self.actual_sha256, self.detail = uri, expected_sha256, actual_sha256, detail
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"integrity check failed for {uri}: expected sha256 {expected_sha256}, "
                         f"got {actual_sha256}{suffix}")

    def __reduce__(self):  # it travels between processes (Ray, rank to rank) with its fields
        return type(self), (self.uri, self.expected_sha256, self.actual_sha256, self.detail)


class StoreWriteError(StoreError):
    """The store refused to write (no space left, read-only, no permission): nothing was left half-written."""


class ArtifactExistsError(StoreError, FileExistsError):
    """A complete, different directory artifact is already stored under the key."""


class StoreAccessError(StoreError, PermissionError):
    """The object store refused the credentials (bad key, bad signature, access denied)."""


class StoreNotFoundError(StoreError):
    """The store's bucket does not exist (or these credentials cannot see it). Not a FileNotFoundError: code
    that takes a missing object for "not written yet" must not mistake a missing bucket for it."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The object store kept failing through every attempt of the store's retry mode."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def client_error_code(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of the first botocore ``ClientError`` in the chain (s3fs keeps it as the
    cause of the OSError it raises), if any."""
    for link in _chain(exc):
        if isinstance(link, botocore.exceptions.ClientError):
            response = link.response or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
            return str(response.get("Error", {}).get("Code", "")), int(status)
    return None


def describe(exc: BaseException) -> str:
    """A short, secret-free label for logs: the exception type and the service's error code."""
    coded = client_error_code(exc)
    return f"{type(exc).__name__} ({coded[0]}, HTTP {coded[1]})" if coded else type(exc).__name__


def s3_error(exc: BaseException, uri: str, bucket: str, endpoint: str, attempts: int) -> StoreError | None:
    """The store error for what an S3 call still raised after its last attempt, or None to re-raise it. The
    service's own message stays in the exception chain: S3 echoes no secret (it never receives one)."""
    coded, chain = client_error_code(exc), list(_chain(exc))
    code, status = coded or ("", 0)
    if (code in _CREDENTIAL_CODES or status == 403 or code == "403"
            or any(isinstance(link, _NO_CREDENTIAL_TYPES) for link in chain)
            or (coded is None and isinstance(exc, PermissionError))):  # s3fs drops the cause on a few paths
        return StoreAccessError(
            f"the object store at {endpoint} refused access to {uri} ({describe(exc)}). Check the credentials: "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or AWS_PROFILE "
            f"and its entry in ~/.aws/credentials; that they may use bucket '{bucket}'; and the endpoint: "
            f"{ENDPOINT_SETTINGS}.")
    if code == "NoSuchBucket":
        return StoreNotFoundError(
            f"bucket '{bucket}' does not exist at {endpoint} (needed for {uri}). Create it, or check the store "
            f"URI, {ENDPOINT_SETTINGS} and AWS_PROFILE.")
    if code in _BUSY_CODES or status >= 500 or status == 429 or (
            coded is None and any(isinstance(link, _DOWN_TYPES) for link in chain)):
        return StoreUnavailableError(
            f"the object store at {endpoint} kept failing for {uri} ({describe(exc)}, {attempts} attempts). "
            f"Check that it is reachable and {ENDPOINT_SETTINGS}.")
    return None


def refused_write(exc: BaseException, uri: str) -> StoreWriteError | None:
    """A filesystem's refusal (full, read-only, no permission) as a ``StoreWriteError`` naming the object and
    the fix, or None for any other error. The write has already removed what it had written."""
    if not isinstance(exc, OSError) or exc.errno not in REFUSED_WRITES:
        return None
    return StoreWriteError(
        f"the store refused to write {uri} ({REFUSED_WRITES[exc.errno]}: {exc.strerror}); nothing of it was "
        "kept. Free space or fix the folder's permissions, or give another --store (DMD2_STORE)")

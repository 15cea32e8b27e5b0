"""Errors of the artifact store, and how faults of the object store are sorted and retried.

Faults fall in three groups:

- *transient* (connection refused/reset, timeouts, HTTP 5xx, 429, SlowDown/Throttling): retried
  with bounded exponential backoff (``RetryPolicy``);
- *configuration* (a missing bucket, refused credentials): raised at once, because waiting does not
  fix them, with a message that names the settings to check and never their values;
- anything else (a missing object, a local I/O error) propagates unchanged.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

import botocore.exceptions
import botocore.parsers

from dmd2.failures import RunError

logger = logging.getLogger(__name__)
T = TypeVar("T")

CREDENTIAL_SETTINGS = (
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), "
    "or AWS_PROFILE and its entry in ~/.aws/credentials"
)
ENDPOINT_SETTINGS = "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (or endpoint_url in ~/.aws/config)"

_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "InvalidToken",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "UnrecognizedClientException",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
    }
)
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError,  # builtin: refused / reset / aborted
    TimeoutError,  # builtin, also socket.timeout and asyncio.TimeoutError
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    botocore.exceptions.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ...
    botocore.exceptions.IncompleteReadError,
    # A throttled S3 can answer with broken XML (fsspec/s3fs#484), so parser errors are retried.
    botocore.parsers.ResponseParserError,
)
_CREDENTIAL_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
)


class StoreError(RunError):
    """Base class of the artifact store's own errors (their messages name the URI and the fix)."""


class IntegrityError(StoreError):
    """Stored bytes do not match the digest they were written with (corruption or tampering)."""

    def __init__(self, uri: str, expected_sha256: str, actual_sha256: str, detail: str = ""):
        self.uri = uri
        self.expected_sha256 = expected_sha256
        self.actual_sha256 = actual_sha256
        self.detail = detail
        suffix = f" ({detail})" if detail else ""
        super().__init__(
            f"integrity check failed for {uri}: expected piece-wise sha256 {expected_sha256}, "
            f"got {actual_sha256}{suffix}"
        )

    def __reduce__(self):  # it travels between processes (Ray, rank to rank) with its fields
        return type(self), (self.uri, self.expected_sha256, self.actual_sha256, self.detail)


class StoreWriteError(StoreError):
    """The store refused to write (no space left, read-only, no permission): nothing was left half-written."""


class ArtifactExistsError(StoreError, FileExistsError):
    """A complete, different directory artifact is already stored under the key."""


class StoreAccessError(StoreError, PermissionError):
    """The object store refused the credentials (bad key, bad signature, access denied)."""


class StoreNotFoundError(StoreError):
    """The store's bucket does not exist (or is invisible to these credentials).

    Deliberately not a FileNotFoundError: code that treats a missing object as "not written yet"
    must not mistake a missing bucket for it.
    """


class StoreUnavailableError(StoreError, ConnectionError):
    """The object store kept failing with transient faults until the retries ran out."""


class Fault(Enum):
    """What kind of failure an exception from the object store is."""

    TRANSIENT = "transient"
    CREDENTIALS = "credentials"
    MISSING_BUCKET = "missing bucket"
    OTHER = "other"


def check_sha256(uri: str, expected: str, actual: str, detail: str = "") -> None:
    """Raise ``IntegrityError`` unless the two digests are equal."""
    if expected != actual:
        raise IntegrityError(uri, expected, actual, detail)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for transient faults of the object store.

    Attempt k (k = 1 .. max_attempts-1) is followed by a sleep of
    ``min(max_delay_s, initial_delay_s * 2**(k-1)) * (1 + jitter * U[0, 1))``; the defaults wait
    0.25 + 0.5 + 1 + 2 + 4 + 4 + 4 s (about 16-19 s) before giving up, enough to ride out a
    restarting endpoint or a failover but not to hide an outage. Jitter only lengthens waits, so that many
    ranks retrying
    together do not hammer the store in lockstep.
    """

    max_attempts: int = 8
    initial_delay_s: float = 0.25
    max_delay_s: float = 4.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0 or self.jitter < 0:
            raise ValueError("retry delays and jitter must be >= 0")

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts: ``max_attempts - 1`` of them."""
        for k in range(self.max_attempts - 1):
            base = min(self.max_delay_s, self.initial_delay_s * 2**k)
            yield base * (1 + self.jitter * random.random())


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def client_error_code(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of the first botocore ``ClientError`` in the chain, if any."""
    for link in _exception_chain(exc):
        if isinstance(link, botocore.exceptions.ClientError):
            response = link.response or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
    return None


def classify(exc: BaseException) -> Fault:
    """Sort an exception raised by s3fs/botocore into a ``Fault``.

    s3fs translates botocore errors into OSError subclasses and keeps the original as the cause,
    so the whole chain is searched; the service's error code decides when one is present.
    """
    coded = client_error_code(exc)
    if coded is not None:
        code, status = coded
        if code in _CREDENTIAL_CODES or status == 403 or code == "403":
            return Fault.CREDENTIALS
        if code == "NoSuchBucket":
            return Fault.MISSING_BUCKET
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return Fault.TRANSIENT
        return Fault.OTHER
    chain = list(_exception_chain(exc))
    if any(isinstance(link, _CREDENTIAL_TYPES) for link in chain):
        return Fault.CREDENTIALS
    if any(isinstance(link, _TRANSIENT_TYPES) for link in chain):
        return Fault.TRANSIENT
    # s3fs drops the cause in a few paths (info/exists) but keeps the 403 as PermissionError.
    if isinstance(exc, PermissionError):
        return Fault.CREDENTIALS
    return Fault.OTHER


def describe(exc: BaseException) -> str:
    """A short, secret-free label for logs: the exception type and the service's error code."""
    coded = client_error_code(exc)
    label = type(exc).__name__
    return f"{label} ({coded[0]}, HTTP {coded[1]})" if coded else label


def call_with_retries(fn: Callable[[], T], policy: RetryPolicy, what: str) -> T:
    """Call ``fn`` until it succeeds, retrying only transient faults, at most ``policy`` times.

    The last exception propagates unchanged (transient or not); the caller translates it.
    ``what`` names the operation and URI for the warning logged before each retry.
    """
    delays = policy.delays()
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == policy.max_attempts or classify(exc) is not Fault.TRANSIENT:
                raise
            delay = next(delays)
            logger.warning(
                "%s failed with %s (attempt %d of %d); retrying in %.2f s",
                what, describe(exc), attempt, policy.max_attempts, delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")

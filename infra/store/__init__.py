"""The artifact store: where tasks put tensors, JSON and directories, and the references to them.

Tasks hand each other ``ArtifactRef``s (``keys``), never tensors. ``ArtifactStore`` (``artifacts``) writes
atomically (``local``, ``s3``), checks every read against the plain sha256 it wrote (``io``), turns what still
fails after botocore's retries into errors naming the settings to check (``faults``), and quarantines a damaged
checkpoint rather than delete it. ``RunLease`` (``lease``) keeps one run per run id.
"""

from infra.store.artifacts import ArtifactStore
from infra.store.faults import (ArtifactExistsError, IntegrityError, StoreAccessError, StoreError, StoreNotFoundError,
                                StoreUnavailableError, StoreWriteError)
from infra.store.keys import ArtifactRef, Checkpoint, validate_key, validate_name
from infra.store.lease import LeaseHeldError, LeaseLostError, RunLease

__all__ = [
    "ArtifactExistsError", "ArtifactRef", "ArtifactStore", "Checkpoint", "IntegrityError", "LeaseHeldError",
    "LeaseLostError", "RunLease", "StoreAccessError", "StoreError", "StoreNotFoundError", "StoreUnavailableError",
    "StoreWriteError", "validate_key", "validate_name",
]

"""The artifact store: where tasks put tensors, JSON and directories, and the references to them.

Tasks hand each other ``ArtifactRef``s, never tensors. A ref names a URI below the store's root
and the digest of the bytes written there (a piece-wise sha256, hashed on every core:
``infra.store.digest``), so every read is checked against what was written:

- **atomic**: a reader never sees a partial object (temp file + rename on ``file://``, one upload
  on ``s3://``); a directory becomes visible when its ``MANIFEST.json`` (each file's digest) is
  written, last;
- **verified**: every read checks the digest and raises ``IntegrityError`` on a mismatch;
- **safe to load**: only safetensors and JSON are ever parsed (never pickle), keys are validated
  (``infra.store.keys``), and refs must lie under this store's root;
- **resilient**: transient S3 faults are retried (``RetryPolicy``); a missing bucket and refused
  credentials fail at once with a message naming the settings to check, never their values.

Layout: ``<root>/<run_id>/rollout-<n>/<task>/rank-<r>.safetensors`` and
``<root>/<run_id>/checkpoints/<step>/`` (``rollout_key``, ``checkpoint_key``).

One run per run id: ``RunLease`` holds a lease on the run id at ``<root>/<run_id>/lease.json``,
changed only by the store's conditional writes (``infra.store.lease``).
"""

from infra.store.artifacts import ArtifactStore
from infra.store.faults import (
    ArtifactExistsError,
    IntegrityError,
    RetryPolicy,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
    StoreWriteError,
)
from infra.store.keys import validate_key, validate_name
from infra.store.lease import LeaseHeldError, LeaseLostError, RunLease
from infra.store.refs import ArtifactRef, Checkpoint

__all__ = [
    "ArtifactExistsError",
    "ArtifactRef",
    "ArtifactStore",
    "Checkpoint",
    "IntegrityError",
    "LeaseHeldError",
    "LeaseLostError",
    "RetryPolicy",
    "RunLease",
    "StoreAccessError",
    "StoreError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "StoreWriteError",
    "validate_key",
    "validate_name",
]

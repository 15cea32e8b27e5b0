"""The artifact store: where tasks put tensors, JSON and directories, and the references to them.

Tasks hand each other ``ArtifactRef``s, never tensors. A ref names a URI below the store's root and the
plain sha256 of the bytes written there (what ``sha256sum`` prints), so every read is checked against what
was written. Both backends go through fsspec (``LocalFileSystem``, ``s3fs``):

- **atomic**: a reader never sees a partial object (temp file + rename on ``file://``, one upload on
  ``s3://``); a directory becomes visible when its ``MANIFEST.json`` (each file's sha256) is written, last;
- **verified**: every read checks the sha256 and raises ``IntegrityError`` on a mismatch (objects of older
  stores, with a piece-wise digest, still verify: ``infra.store.digest``);
- **safe to load**: only safetensors and JSON are ever parsed (never pickle), keys are validated
  (``infra.store.keys``), and refs must lie under this store's root;
- **resilient**: S3 requests are retried by botocore's retry mode alone (``ArtifactStore(root, retry_mode,
  max_attempts)``); a missing bucket and refused credentials fail at once with a message naming the
  settings to check, never their values;
- **kept**: a damaged checkpoint is quarantined, never deleted (``ArtifactStore.resume_checkpoint``).

Layout: ``<root>/<run_id>/rollout-<n>/<task>/rank-<r>.safetensors`` and ``<root>/<run_id>/checkpoints/<step>/``
(``rollout_key``, ``checkpoint_key``). One run per run id: ``RunLease`` holds a lease on the run id at
``<root>/<run_id>/lease.json``, changed only by the store's conditional writes (``infra.store.lease``).
"""

from infra.store.artifacts import ArtifactStore
from infra.store.faults import (ArtifactExistsError, IntegrityError, StoreAccessError, StoreError, StoreNotFoundError,
                                StoreUnavailableError, StoreWriteError)
from infra.store.keys import validate_key, validate_name
from infra.store.lease import LeaseHeldError, LeaseLostError, RunLease
from infra.store.refs import ArtifactRef, Checkpoint

__all__ = [
    "ArtifactExistsError", "ArtifactRef", "ArtifactStore", "Checkpoint", "IntegrityError", "LeaseHeldError",
    "LeaseLostError", "RunLease", "StoreAccessError", "StoreError", "StoreNotFoundError", "StoreUnavailableError",
    "StoreWriteError", "validate_key", "validate_name",
]

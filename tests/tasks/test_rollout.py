from prefect.states import Completed, Failed

from infra.store import StoreUnavailableError
from tasks.rollout import _transient


def test_only_transient_faults_are_retried():
    # A store that stayed down through the store's own retries (botocore's) is not retried again.
    assert not _transient(None, None, Failed(data=StoreUnavailableError("s3 is down")))
    assert _transient(None, None, Failed(data=ConnectionRefusedError()))
    assert not _transient(None, None, Failed(data=ValueError("bad input")))
    assert not _transient(None, None, Completed(data=1))

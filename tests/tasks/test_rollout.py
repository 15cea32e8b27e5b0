from prefect.states import Completed, Failed

from infra.store.faults import StoreUnavailableError
from tasks.rollout import _transient


def test_only_transient_faults_are_retried():
    assert _transient(None, None, Failed(data=StoreUnavailableError("s3 is down")))
    assert _transient(None, None, Failed(data=ConnectionRefusedError()))
    assert not _transient(None, None, Failed(data=ValueError("bad input")))
    assert not _transient(None, None, Completed(data=1))

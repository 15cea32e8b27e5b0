"""One run per run id, for runs started inside Prefect: a lease on the run id in the store
(infra/store/lease.py) decides. Two CLI runs at once are tests/flows/test_cli_twice.py's."""

import pytest
from mlflow import MlflowClient

from flows.distill import distill
from infra.store import ArtifactStore, LeaseHeldError, RunLease
from tests.flows.conftest import write_recipe
from tests.tracking_db import tracking_uri_in


def test_the_flow_refuses_a_held_run_id_before_it_starts_an_mlflow_run(prefect_server, tiny_teacher_dir, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", tiny_teacher_dir, rollouts=2)
    store_uri = (tmp_path / "store").as_uri()
    tracking = tracking_uri_in(tmp_path)
    with RunLease.acquire(ArtifactStore(store_uri), "busy", "another flow run on host-b"):
        with pytest.raises(LeaseHeldError, match="another flow run on host-b"):
            distill(recipe=str(recipe), run_id="busy", store_uri=store_uri, tracking_uri=tracking,
                    output_dir=str(tmp_path / "outputs"), cache_dir=str(tmp_path / "cache"))
    client = MlflowClient(tracking)
    experiment = client.get_experiment_by_name("dmd2")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []

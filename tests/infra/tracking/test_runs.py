"""MLflow on sqlite (the real tracking store), no server."""

import numpy as np
import pytest
from mlflow import MlflowClient

from infra.tracking.runs import RunTracker, flatten_params, tracking_uri


@pytest.fixture
def uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a test leaves in the working directory stays in its tmp_path
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_flatten_params():
    assert flatten_params({"dmd2": {"k": 5, "range": (0.1, 0.9)}, "seed": 0}) == {
        "dmd2.k": "5", "dmd2.range": "(0.1, 0.9)", "seed": "0"}


def test_tracking_uri_default_and_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert tracking_uri() == "sqlite:///elsewhere.db" and tracking_uri("x") == "x"


def test_a_sqlite_runs_artifacts_go_beside_its_database_not_into_the_working_directory(tmp_path, monkeypatch):
    elsewhere = tmp_path / "started-here"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    database = tmp_path / "team" / "mlflow.db"
    database.parent.mkdir()
    tracker = RunTracker.start_or_resume("run-a", uri=f"sqlite:///{database}")
    picture = tmp_path / "samples.txt"
    picture.write_text("x")
    tracker.client.log_artifact(tracker.mlflow_run_id, str(picture))
    assert list((database.parent / "mlruns").rglob("samples.txt"))  # with the database
    assert not any(elsewhere.iterdir())  # nothing left where the run happened to start
    # the relative form (the default sqlite:///mlflow.db) is relative to where the database file is opened
    monkeypatch.chdir(database.parent)
    assert RunTracker.start_or_resume("run-b", uri="sqlite:///mlflow.db").client.get_experiment_by_name(
        "dmd2").artifact_location == (database.parent / "mlruns").as_uri()


def test_a_resumed_run_is_the_same_mlflow_run_and_logs_no_step_twice(uri):
    first = RunTracker.start_or_resume("run-a", uri=uri)
    first.log_params({"train": {"seed": 0}})
    for step in range(3):
        first.log_metrics(step, {"train/loss": float(step)})
    first.log_image("samples", np.zeros((8, 8), dtype=np.uint8), step=2)
    first.finish("FAILED")

    again = RunTracker.start_or_resume("run-a", uri=uri)
    assert again.mlflow_run_id == first.mlflow_run_id
    again.log_params({"train": {"seed": 0}})
    for step in range(1, 5):  # replays steps 1 and 2 after a resume from an earlier checkpoint
        again.log_metrics(step, {"train/loss": 10.0 + step})
    again.log_image("samples", np.zeros((8, 8), dtype=np.uint8), step=2)
    again.finish()

    client = MlflowClient(uri)
    history = client.get_metric_history(first.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4]
    assert {m.step: m.value for m in history}[2] == 2.0  # the first run's point stays
    images = [a.path for a in client.list_artifacts(first.mlflow_run_id, "images") if a.path.endswith(".png")]
    assert len(images) == 1
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"
    with pytest.raises(ValueError, match="other values for \\['train.seed'\\]"):
        again.log_params({"train": {"seed": 1}})
    assert RunTracker.start_or_resume("run-b", uri=uri).mlflow_run_id != first.mlflow_run_id


def test_a_refused_rerun_leaves_a_finished_run_finished_and_a_failed_one_fails(uri):
    first = RunTracker.start_or_resume("r", uri=uri)
    first.log_metrics(0, {"train/loss": 1.0})
    first.finish("FINISHED")
    refused = RunTracker.start_or_resume("r", uri=uri)  # e.g. a changed recipe: nothing is logged
    refused.finish("FAILED")
    assert refused.client.get_run(refused.mlflow_run_id).info.status == "FINISHED"
    crashed = RunTracker.start_or_resume("r", uri=uri)
    crashed.log_metrics(1, {"train/loss": 0.5})  # it trained, then died
    crashed.finish("FAILED")
    assert crashed.client.get_run(crashed.mlflow_run_id).info.status == "FAILED"


def test_every_flow_run_is_recorded_in_its_own_tag(uri):
    for flow_run in ("f1", "f2"):
        tracker = RunTracker.start_or_resume("r", uri=uri)
        tracker.record_flow_run(flow_run, f"note {flow_run}")
        tracker.finish()
    tags = tracker.client.get_run(tracker.mlflow_run_id).data.tags
    assert {k: v for k, v in tags.items() if k.startswith("prefect.flow_run.")} == {
        "prefect.flow_run.f1": "note f1", "prefect.flow_run.f2": "note f2"}
    assert tags["prefect.flow_run_id"] == "f2"


def test_queued_metrics_go_in_few_requests_and_none_is_lost(uri, monkeypatch):
    """Per-rollout metrics wait in a queue for `batch_seconds`; an image, an immediate log and the run's
    end send what waits. Every point arrives once, at its step, with its value."""
    tracker = RunTracker.start_or_resume("run-q", uri=uri)
    requests = []
    send = tracker.client.log_batch
    monkeypatch.setattr(tracker.client, "log_batch", lambda *a, **k: requests.append(k) or send(*a, **k))
    tracker.batch_seconds = 3600.0  # nothing is old enough to go on its own
    for step in range(4):
        tracker.queue_metrics(step, {"train/loss": float(step), "time/rollout": 0.5})
    assert requests == []
    tracker.log_image("samples", np.zeros((8, 8), dtype=np.uint8), step=3)  # sends the queue first
    assert len(requests) == 1 and len(requests[0]["metrics"]) == 8
    tracker.queue_metrics(4, {"train/loss": 4.0})
    tracker.queue_metrics(3, {"train/loss": 99.0})  # already logged: skipped, as log_metrics skips it
    tracker.finish("FAILED")  # a failing run still sends what it queued
    assert len(requests) == 2
    tracker.batch_seconds = 0.0  # every call old enough: one request per call
    tracker.queue_metrics(5, {"train/loss": 5.0})
    assert len(requests) == 3

    history = MlflowClient(uri).get_metric_history(tracker.mlflow_run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(6)]

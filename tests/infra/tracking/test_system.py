"""System metrics of a node (infra/tracking/system.py) on MLflow's own monitor, MLflow on sqlite."""

import time

import pytest
from mlflow import MlflowClient

from infra.tracking.runs import RunTracker
from infra.tracking.system import SystemMetrics, stop
from tests.tracking_db import tracking_uri_in


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a test leaves in the working directory stays in its tmp_path
    return RunTracker.start_or_resume("run-s", uri=tracking_uri_in(tmp_path))


def test_a_rank_shorter_than_one_interval_still_logs_its_system_metrics(tracker):
    target = SystemMetrics.of(tracker.client.tracking_uri, tracker.mlflow_run_id, interval_s=60.0)
    monitor = target.on("10.0.0.1-a1b2c3").start()
    time.sleep(0.5)  # MLflow's monitor would log its first window after 60 s; the rank ends long before
    stop(monitor)
    metrics = MlflowClient(tracker.client.tracking_uri).get_run(tracker.mlflow_run_id).data.metrics
    assert "system/10.0.0.1-a1b2c3/cpu_utilization_percentage" in metrics
    assert 0 < metrics["system/10.0.0.1-a1b2c3/system_memory_usage_megabytes"]


def test_the_last_window_follows_the_logged_ones_without_repeating_a_step(tracker):
    target = SystemMetrics.of(tracker.client.tracking_uri, tracker.mlflow_run_id, interval_s=0.2)
    monitor = target.on("10.0.0.2-d4e5f6").start()
    time.sleep(1.5)  # several windows logged by the monitor itself, then one in progress
    stop(monitor)
    history = MlflowClient(tracker.client.tracking_uri).get_metric_history(
        tracker.mlflow_run_id, "system/10.0.0.2-d4e5f6/cpu_utilization_percentage")
    steps = sorted(m.step for m in history)
    assert len(steps) >= 2 and steps == list(range(len(steps)))

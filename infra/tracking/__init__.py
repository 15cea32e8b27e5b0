"""MLflow tracking of distill runs (one MLflow run per run id, resumable, no step logged twice)."""

from infra.tracking.runs import DEFAULT_TRACKING_URI, RunTracker, tracking_uri

__all__ = ["DEFAULT_TRACKING_URI", "RunTracker", "tracking_uri"]

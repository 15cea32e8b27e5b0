"""MLflow tracking of distill runs (one MLflow run per run id, resumable, no step logged twice), and the
exported student as an MLflow model, registered with a quality-gated `champion` alias.

Exports load on first use (`dmd2.lazy`): a rank worker needs only `SystemMetrics`, and importing MLflow in
every rank process cost seconds at each trainer group's start."""

from dmd2.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "credentials": ["redacted", "refuse_user_info", "uri_to_pass_on"],
    "registry": ["CHAMPION", "LATEST_URI", "RegisteredStudent", "register_student"],
    "runs": ["DEFAULT_TRACKING_URI", "RunTracker", "tracking_uri"],
    "student_model": ["StudentModel", "log_student_model"],
    "system": ["SystemMetrics"],
})

__all__ = ["CHAMPION", "DEFAULT_TRACKING_URI", "LATEST_URI", "RegisteredStudent", "RunTracker", "StudentModel",
           "SystemMetrics", "log_student_model", "redacted", "refuse_user_info", "register_student", "tracking_uri",
           "uri_to_pass_on"]

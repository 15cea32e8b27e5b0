"""MLflow tracking of distill runs (one MLflow run per run id, resumable, no step logged twice), and the
exported student as an MLflow model, registered with a quality-gated `champion` alias."""

from infra.tracking.credentials import redacted, refuse_user_info, uri_to_pass_on
from infra.tracking.registry import CHAMPION, LATEST_URI, RegisteredStudent, register_student
from infra.tracking.runs import DEFAULT_TRACKING_URI, RunTracker, tracking_uri
from infra.tracking.student_model import StudentModel, log_student_model
from infra.tracking.system import SystemMetrics

__all__ = ["CHAMPION", "DEFAULT_TRACKING_URI", "LATEST_URI", "RegisteredStudent", "RunTracker", "StudentModel",
           "SystemMetrics", "log_student_model", "redacted", "refuse_user_info", "register_student", "tracking_uri",
           "uri_to_pass_on"]

"""System metrics of the run's nodes in its MLflow run: CPU, memory, disk, network and (with NVML) every GPU,
sampled by MLflow's own monitor in one rank per node, under the node's label (`system/<ip>-<node id>/...`)."""

import logging
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class SystemMetrics:
    """Where a rank logs its node's system metrics, and under which label; plain values, so it travels to the
    rank workers."""

    tracking_uri: str
    mlflow_run_id: str
    interval_s: float = 10.0
    node: str = "node"

    @classmethod
    def of(cls, tracking_uri: str, mlflow_run_id: str, interval_s: float = 10.0) -> "SystemMetrics":
        """For ranks whose working directory may differ from the driver's: a relative sqlite path made absolute."""
        prefix = "sqlite:///"
        if tracking_uri.startswith(prefix) and not tracking_uri[len(prefix):].startswith("/"):
            tracking_uri = prefix + str(Path(tracking_uri[len(prefix):]).resolve())
        return cls(tracking_uri, mlflow_run_id, interval_s)

    def on(self, node: str) -> "SystemMetrics":
        """The same, labelled ``node``."""
        return replace(self, node=node)

    def start(self):
        """A running `SystemMetricsMonitor` of this node under its label; `stop` it at the end.

        `resume_logging` continues the node's step count, so a resumed run logs no step twice.
        """
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # only ranks that log need it

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # a line per node otherwise
        monitor = SystemMetricsMonitor(self.mlflow_run_id, sampling_interval=self.interval_s, resume_logging=True,
                                       node_id=self.node, tracking_uri=self.tracking_uri)
        monitor.start()
        return monitor


def stop(monitor) -> None:
    """Stop a monitor from `SystemMetrics.start` and log its last window too. MLflow's monitor logs a window
    once its interval has passed, and its `finish` drops the window in progress: a rank that lives less than
    one interval (a short run) would log nothing at all, and every run would lose its last seconds."""
    monitor.finish()  # joins the sampling thread, so nothing else touches the samples now
    if last_window := monitor.aggregate_metrics():  # the samples taken since the last logged window
        monitor.publish_metrics(last_window)
        monitor.mlflow_logger.flush()

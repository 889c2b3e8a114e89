"""The machine's own metrics beside a training's curves: MLflow's system metrics monitor on its run.

Rank 0 samples every ``logging.system_metrics_interval`` seconds, in a thread of MLflow's
(``SystemMetricsMonitor``): CPU utilisation and host memory always (psutil), disk and network,
and per GPU its utilisation, memory and power where ``nvidia-ml-py`` finds one (NVML). They
appear under ``system/`` in the run (MLflow's System metrics tab), each sample a step of their
own. What a caller relies on: :meth:`SystemMetrics.start` never raises (a monitor that cannot
start is a warning; None), a server that fails stops only the monitor (MLflow's thread ends
with a warning), and :meth:`SystemMetrics.stop` returns within ``STOP_WAIT_S`` whatever the
server does. MLflow's ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` overrides the interval. The
manual: docs/mlflow.md#system-metrics.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["STOP_WAIT_S", "SystemMetrics"]

log = logging.getLogger("unmask.tracking")

# The longest a run's end waits for the monitor's last sample to reach the server.
STOP_WAIT_S = 15.0


class SystemMetrics:
    """MLflow's monitor of this machine, logging to one run."""

    def __init__(self, monitor) -> None:
        self.monitor = monitor

    @classmethod
    def start(cls, tracking_uri: str, run_id: str, interval_s: float) -> SystemMetrics | None:
        """Sample every ``interval_s`` seconds into run ``run_id`` (a resumed run's samples
        continue its steps); None when ``interval_s`` is 0 or the monitor cannot start."""
        if interval_s <= 0:
            return None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                           tracking_uri=tracking_uri)
            monitor.start()
        except Exception as err:  # the machine's metrics are never worth the run
            log.warning("MLflow's system metrics did not start (%s: %s); training goes on without them",
                        type(err).__name__, str(err)[:200])
            return None
        return cls(monitor)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop sampling and send what is left, waiting at most ``wait_s`` seconds."""
        finisher = threading.Thread(target=self.monitor.finish, name="unmask-system-metrics-stop", daemon=True)
        finisher.start()
        finisher.join(wait_s)
        if finisher.is_alive():
            log.warning("MLflow's system metrics: the last samples did not reach the server within %.0f s; "
                        "they are dropped", wait_s)

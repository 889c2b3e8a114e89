"""What a training run records as it goes: ``RUN/metrics.jsonl`` and its MLflow run.

Rank 0 appends every metric to metrics.jsonl (``pipeline.run_dir.metrics_log``) and queues
it for MLflow (``pipeline.tracking.background``: an outage never costs a step); the other
ranks record nothing. A failed write of metrics.jsonl does not stop the step: it is kept in
``failure``, for the loop to raise at the next step boundary once every rank has
checkpointed. ``start_tracking`` opens the run's MLflow run (``Tracker.open``) and logs its
identity (``RunIdentity``) once; a server that does not answer stops the run, or with
``logging.mlflow_required`` off the run goes on without it. The machine's metrics go to the same
run (``pipeline.tracking.system_metrics``). The manual: docs/mlflow.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError
from pipeline.config import LoggingSection
from pipeline.run_dir.checkpoint import write_failure
from pipeline.run_dir.layout import RunLayout
from pipeline.run_dir.metrics_log import MetricsLog
from pipeline.tracking.background import FAILED_CLOSE_WAIT_S, BackgroundTracker
from pipeline.tracking.system_metrics import STOP_WAIT_S, SystemMetrics
from pipeline.tracking.tracker import OPTIONAL_WAIT_S, REACHABLE_WAIT_S, Tracker, TrackingUnreachable, flatten_params

__all__ = ["RunIdentity", "RunRecords"]

log = logging.getLogger("unmask.train")


@dataclass(frozen=True)
class RunIdentity:
    """What the MLflow run of a training records once, at its start (before any step)."""

    params: dict                         # nested (the config's sections, "resolved", ...), logged flat
    tags: dict[str, str]
    texts: dict[str, str]                # artifact file -> its text
    # Fields changed since the run started (config_differences' words), and the step they
    # took effect: MLflow params are immutable, so these keep their first values and the
    # change is a tag.
    changes: list[str] = field(default_factory=list)
    step: int = 0


class RunRecords:
    """The records of the run in ``run_dir``; ``main``: this process is rank 0, the one that writes."""

    def __init__(self, run_dir: Path, main: bool) -> None:
        self.run_dir, self.main = Path(run_dir), main
        self.metrics = MetricsLog(RunLayout(run_dir).metrics)
        self.tracker: BackgroundTracker | None = None
        self.system_metrics: SystemMetrics | None = None
        self.failure: UserError | None = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id; None without one."""
        return self.tracker.run_id if self.tracker is not None else None

    def forget_after(self, step: int) -> None:
        """Drop the records of the steps after ``step``, the point the run resumes from."""
        if self.main:
            self.metrics.forget_after(step)

    def start_tracking(self, logging_: LoggingSection, identity: RunIdentity, resume_point: int) -> None:
        """Open the MLflow run (``logging.mlflow``), log ``identity``, and skip the steps after
        ``resume_point`` it already holds (they are logged again)."""
        if not (self.main and logging_.mlflow):
            return
        try:
            tracker = Tracker.open(self.run_dir, tracking_uri=logging_.mlflow_uri, experiment=logging_.experiment,
                                   run_name=logging_.run_name,
                                   wait_s=REACHABLE_WAIT_S if logging_.mlflow_required else OPTIONAL_WAIT_S)
            _log_identity(tracker, identity)
            skip = tracker.logged_steps_after(resume_point)
        except TrackingUnreachable as err:
            if logging_.mlflow_required:
                raise
            log.warning("%s. Training without MLflow (logging.mlflow_required is false); metrics go to %s",
                        str(err).split("; ")[0], self.metrics.path)
            return
        except UserError:
            raise
        except Exception as err:  # the server failed between its health check and our first requests
            raise TrackingUnreachable(f"MLflow at {logging_.mlflow_uri or 'the run directory'} failed at the start "
                                      f"of the run ({type(err).__name__}: {str(err)[:300]}); retry, or pass "
                                      "--logging.mlflow_required false to train without it") from None
        self.tracker = BackgroundTracker(tracker, skip=skip, metrics_file=str(self.metrics.path))
        self.system_metrics = SystemMetrics.start(tracker.tracking_uri, tracker.run_id,
                                                  logging_.system_metrics_interval)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Rank 0: append to metrics.jsonl and queue for MLflow (a failed write: ``failure``)."""
        if not self.main:
            return
        try:
            self.metrics.append(metrics, step)
        except OSError as err:
            self.failure = self.failure or write_failure(err, self.metrics.path, self.run_dir)
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step)

    def close(self, status: str) -> None:
        """End the MLflow run as FINISHED, KILLED or FAILED (a failed run waits less for it); the
        machine's metrics stop first (their last samples go to a run still running)."""
        if self.system_metrics is not None:
            self.system_metrics.stop(FAILED_CLOSE_WAIT_S if status == "FAILED" else STOP_WAIT_S)
            self.system_metrics = None
        if self.tracker is not None:
            if status == "FAILED":
                self.tracker.close(status, wait_s=FAILED_CLOSE_WAIT_S)
            else:
                self.tracker.close(status)


def _log_identity(tracker: Tracker, identity: RunIdentity) -> None:
    params = flatten_params(identity.params)
    if identity.changes:
        changed = {change.split(":")[0] for change in identity.changes}
        params = {k: v for k, v in params.items() if k not in changed}
        tracker.set_tags({f"config_change.step_{identity.step}": "; ".join(identity.changes)})
    tracker.log_params(params)
    tracker.set_tags(identity.tags)
    for name, text in identity.texts.items():
        tracker.log_text(text, name)

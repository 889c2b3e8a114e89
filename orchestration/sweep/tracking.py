"""A sweep's MLflow record: one parent run for the sweep, each trial's training run its child.

The parent is created in the base config's experiment and tracking URI and recorded in
``SWEEP/mlflow_run.json`` (a rerun of the sweep continues it). Each trial's own training run
(``pipeline.tracking``) becomes a child when its trial ends: the tag ``mlflow.parentRunId``, the
point (process, budget, size, parameters, steps) as params and its final bound as a metric. The
fits and plots go to the parent at the end. Tracking may fail without failing the sweep: a
server that does not answer costs a warning, never a trial. The manual: docs/scaling.md#tracked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from common.errors import UserError
from orchestration.sweep.plan import Trial
from orchestration.sweep.trials import TrialOutcome, TrialPaths
from pipeline.config import Config
from pipeline.tracking.tracker import Tracker, tracking_failures

__all__ = ["PARENT_TAG", "SweepTracking"]

log = logging.getLogger("unmask.sweep")
PARENT_TAG = "mlflow.parentRunId"   # MLflow's own: the UI nests a child under its parent


class SweepTracking:
    """The parent run, or nothing when the base config turns MLflow off or it does not answer."""

    def __init__(self, tracker: Tracker | None) -> None:
        self.tracker = tracker

    @classmethod
    def open(cls, sweep_dir: Path, base: Config, name: str) -> SweepTracking:
        logging_ = base.logging
        if not logging_.mlflow:
            return cls(None)
        try:
            tracker = Tracker.open(sweep_dir, tracking_uri=logging_.mlflow_uri, experiment=logging_.experiment,
                                   run_name=name)
        except (*tracking_failures(), UserError) as err:
            log.warning("unmask sweep: warning: no MLflow parent run (%s); the sweep goes on, its record is "
                        "in %s", err, sweep_dir)
            return cls(None)
        return cls(tracker)

    @property
    def run_id(self) -> str | None:
        return self.tracker.run_id if self.tracker else None

    def _guarded(self, what: str, call) -> None:
        if self.tracker is None:
            return
        try:
            call()
        except (*tracking_failures(), UserError) as err:
            log.warning("unmask sweep: warning: MLflow: %s failed (%s); the sweep goes on", what, err)

    def describe(self, tags: dict[str, str]) -> None:
        """The sweep's file, budgets, processes and trial count: tags, which a grown sweep updates."""
        self._guarded("tagging the sweep", lambda: self.tracker.set_tags(tags))

    def adopt(self, trial: Trial, outcome: TrialOutcome, sweep_dir: Path) -> None:
        """Make the trial's training run a child of the parent, with its point and bound."""
        def call() -> None:
            child = Tracker.attach(TrialPaths(sweep_dir, trial.name).run_dir)
            if child is None:
                return
            record = trial.record()
            child.set_tags({PARENT_TAG: self.tracker.run_id, "sweep.status": outcome.status})
            child.log_params({f"sweep.{key}": f"{record[key]:g}" if isinstance(record[key], float) else str(record[key])
                              for key in ("process", "budget", "size", "parameters", "steps", "flops_per_token")})
            if outcome.nelbo_per_token is not None:
                child.log_metrics({"sweep/nelbo_per_token": outcome.nelbo_per_token}, outcome.step or 0)
        self._guarded(f"adopting trial {trial.name}", call)

    def finish(self, metrics: dict[str, float], artifacts: list[Path], failed: bool) -> None:
        def call() -> None:
            self.tracker.log_metrics(metrics, 0)
            for path in artifacts:
                self.tracker.log_artifact(path, "sweep")
            self.tracker.finish("FAILED" if failed else "FINISHED")
        self._guarded("the sweep's fits and plots", call)

"""Running a sweep's trials on Ray: one Ray task per trial, resumed, retried, recorded.

Each trial is a Ray task holding the sweep's ``resources`` (CPUs, GPUs) that runs the ordinary
training loop (``pipeline.training.trainer.train``) into its own run directory
``SWEEP/trials/NAME``: Ray places the tasks on the cluster's workers, one trial per worker slot,
and retries a failed task ``max_retries`` times (``retry_exceptions``: a training that raised runs
again, from its latest checkpoint). A trial's outcome goes to ``SWEEP/state/NAME.json`` as soon
as it ends: a rerun skips the finished ones (their directories untouched), resumes interrupted
ones from their checkpoints (the loop's ``--resume auto``) and runs failed ones again. Every
attempt is a line of ``SWEEP/state/NAME.attempts``. The manual: docs/scaling.md#on-ray.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.atomic_files import atomic_write_bytes
from common.outputs import json_object
from orchestration.sweep.plan import Trial
from pipeline.config import Config, config_differences
from pipeline.run_dir.checkpoint import latest_step
from pipeline.run_dir.layout import RunLayout
from pipeline.training.hooks import TrainHooks

__all__ = ["TrialOutcome", "TrialPaths", "final_validation", "finished_outcome", "run_trials"]

# The message of a failed trial: its first line, this long at most (the traceback is in Ray's log).
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class TrialPaths:
    """Where a trial lives in the sweep's directory."""

    sweep_dir: Path
    name: str

    @property
    def run_dir(self) -> Path:
        return self.sweep_dir / "trials" / self.name

    @property
    def state(self) -> Path:
        return self.sweep_dir / "state" / f"{self.name}.json"

    @property
    def attempts(self) -> Path:
        return self.sweep_dir / "state" / f"{self.name}.attempts"


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended: its final validation bound, or why it failed."""

    name: str
    status: Literal["finished", "failed"]
    attempts: int                      # every attempt so far, over all runs of the sweep
    step: int | None = None
    nelbo_per_token: float | None = None   # the final validation bound (AR: its exact NLL), nats per token
    bits_per_byte: float | None = None
    mlflow_run_id: str | None = None
    error: str | None = None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(asdict(self), indent=2) + "\n").encode())

    @classmethod
    def read(cls, path: Path) -> TrialOutcome | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None   # no outcome (or a torn one): the trial runs, or resumes


def _attempts(paths: TrialPaths) -> int:
    return len(paths.attempts.read_text().splitlines()) if paths.attempts.is_file() else 0


def final_validation(run_dir: Path, step: int) -> dict | None:
    """The validation record the loop logged at ``step`` (its last), from ``RUN/metrics.jsonl``."""
    found = None
    path = RunLayout(run_dir).metrics
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue   # a line torn by a kill
        if record.get("step") == step and "val/nelbo_per_token" in record:
            found = record
    return found


def _same_config(trial: Trial, run_dir: Path) -> bool:
    """Whether the run trained the trial's config: every field a resume checks, and the
    validation batches of its bound (a field a resume may change)."""
    saved, current = json_object(RunLayout(run_dir).config) or {}, trial.config.to_dict()
    return (not config_differences(saved, current)
            and saved.get("eval", {}).get("batches") == current["eval"]["batches"])


def finished_outcome(trial: Trial, paths: TrialPaths) -> TrialOutcome | None:
    """The outcome of a trial whose run reached its last step with its final validation, on the
    trial's config (a sweep file changed since: the trial runs, and its run's resume check names
    what changed)."""
    if (latest_step(paths.run_dir) or 0) < trial.steps or not _same_config(trial, paths.run_dir):
        return None
    record = final_validation(paths.run_dir, trial.steps)
    if record is None:
        return None
    mlflow = RunLayout(paths.run_dir).mlflow_record
    run_id = json.loads(mlflow.read_text()).get("run_id") if mlflow.is_file() else None
    return TrialOutcome(trial.name, "finished", _attempts(paths), trial.steps, record["val/nelbo_per_token"],
                        record.get("val/bits_per_byte"), run_id)


class TrialStopped(RuntimeError):
    """The trial's training stopped on a signal (its checkpoint written): the sweep resumes it."""


def _train_trial(config: Config, data: str, run_dir: str, attempts: str, hooks: TrainHooks) -> int:
    """The Ray task: one attempt at a trial (a new run, or the resumption of an interrupted one)."""
    from common.logs import configure_logging
    from pipeline.training.trainer import train

    configure_logging()
    Path(attempts).parent.mkdir(parents=True, exist_ok=True)
    with open(attempts, "a") as log:   # one line per attempt: retries are counted where they run
        log.write(f"{time.time():.3f}\n")
    result = train(config, data_dir=data, run_dir=run_dir, hooks=hooks)
    if result.preempted:
        raise TrialStopped(f"stopped by a signal at step {result.step}")
    return result.step


def _first_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    text = f"{type(cause).__name__}: {cause}".strip().splitlines()[0]
    return text[:MAX_ERROR_CHARS]


def run_trials(trials: list[Trial], sweep_dir: Path, data: str, *, cpus: float, gpus: float, max_retries: int,
               hooks: TrainHooks,
               on_outcome: Callable[[Trial, TrialOutcome], None] = lambda trial, outcome: None) -> list[TrialOutcome]:
    """Run ``trials`` as Ray tasks on the Ray this process joined (``common.ray_runtime.ray_session``),
    at most as many at once as the cluster's resources hold; each outcome is written, and given to
    ``on_outcome``, as soon as its trial ends."""
    import ray

    task = ray.remote(_train_trial).options(num_cpus=cpus, num_gpus=gpus, max_retries=max_retries,
                                            retry_exceptions=True)
    pending = {}
    for trial in trials:
        paths = TrialPaths(sweep_dir, trial.name)
        ref = task.remote(trial.config, data, str(paths.run_dir), str(paths.attempts), hooks)
        pending[ref] = (trial, paths)
    outcomes = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        trial, paths = pending.pop(done[0])
        try:
            ray.get(done[0])
            outcome = finished_outcome(trial, paths) or TrialOutcome(
                trial.name, "failed", _attempts(paths), error="the run ended without its final validation")
        except (ray.exceptions.RayError, ray.exceptions.RayTaskError) as err:
            outcome = TrialOutcome(trial.name, "failed", _attempts(paths), latest_step(paths.run_dir),
                                   error=_first_line(err))
        outcome.write(paths.state)
        on_outcome(trial, outcome)
        outcomes.append(outcome)
    return outcomes

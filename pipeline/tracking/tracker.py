"""MLflow tracking for training runs: one MLflow run per training run, resumable.

Rank 0 opens a :class:`Tracker` in the run directory (``Tracker.open``): it creates the MLflow
run, or resumes the one recorded in ``RUN/mlflow_run.json`` (its URI and id), so a resumed
training keeps logging into the same run. The store is ``--mlflow-uri`` if given, else
``MLFLOW_TRACKING_URI``, else the SQLite store shared by every run (``shared_store``). An
``http(s)`` server must answer at the start (``check_reachable``, at most ``REACHABLE_WAIT_S``);
the training loop logs through ``pipeline.tracking.background``, so an outage never blocks a
step. The manual: docs/mlflow.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from pipeline.run_dir.layout import RunLayout

# MLflow is imported where it is used: importing it takes over a second, which every command
# (``unmask --help`` too) would otherwise pay at its start.
if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

DEFAULT_EXPERIMENT = "unmask"
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
RECORD_KEYS = ("tracking_uri", "run_id", "experiment_id")
# Creating a store logs its schema creation and every migration step at INFO.
QUIETED_LOGGERS = ("alembic",)
# MLflow's SQL store logs every database error with its traceback, then raises it: the
# caller (background_tracking) reports it in one line, so the log would only repeat it.
SILENCED_LOGGERS = ("mlflow.store.db.utils",)
MS_PER_SECOND = 1000
HOME_ENV, DEFAULT_HOME = "UNMASK_HOME", "~/.unmask"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
STORE_DIR, STORE_FILE, ARTIFACTS_DIR = "mlflow", "mlflow.db", "mlartifacts"
RUN_DIR_TAG = "unmask.run_dir"
# How long a tracking server may take to answer at the start before the run gives up on it.
REACHABLE_WAIT_S = 30.0
# When the run may go on without the server, one try is enough.
OPTIONAL_WAIT_S = 5.0
PROBE_TIMEOUT_S = 5.0
PROBE_PAUSE_S = 1.0
# MLflow's own HTTP client retries a failed request 7 times with doubling pauses and waits up
# to 120 s for each answer: one call to a server that went away blocks for minutes. unmask
# retries on its own terms (background_tracking), so its requests fail fast unless the user
# set these variables.
HTTP_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                     "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


class TrackingUnreachable(UserError):
    """The tracking server did not answer at the start of a run."""


def tracking_failures() -> tuple[type[Exception], ...]:
    """What a tracking server that is down or failing raises: the classes to catch."""
    from mlflow.exceptions import MlflowException

    return (TrackingUnreachable, MlflowException, OSError)


def _is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def check_reachable(uri: str, wait_s: float = REACHABLE_WAIT_S) -> None:
    """Return once the server at ``uri`` answers any HTTP request (``/health``), or raise
    :class:`TrackingUnreachable` naming the URI after ``wait_s``. Other stores (SQLite,
    files) are local and are not probed."""
    if not _is_http(uri):
        return
    import requests

    deadline = time.monotonic() + wait_s
    while True:
        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S)
            return
        except requests.RequestException as err:
            if time.monotonic() + PROBE_PAUSE_S >= deadline:
                raise TrackingUnreachable(
                    f"MLflow tracking server {uri} did not answer for {wait_s:.0f} s ({type(err).__name__}); "
                    "start it or fix --mlflow-uri, or pass --logging.mlflow_required false to train "
                    "without it (metrics stay in RUN/metrics.jsonl)") from None
        time.sleep(PROBE_PAUSE_S)


def fail_fast_http() -> None:
    """MLflow HTTP requests from this process fail within seconds (see HTTP_ENV_DEFAULTS)."""
    for name, value in HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def unmask_home() -> Path:
    """Where unmask keeps what is shared by all runs of this user (``UNMASK_HOME``)."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser().resolve()


def shared_store() -> Path:
    """The directory of the shared local MLflow store: ``mlflow.db`` and its artifacts."""
    return unmask_home() / STORE_DIR


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` when set, else the shared SQLite store: the name ``mlflow.db``
    is MLflow's own default, so ``mlflow ui`` started in :func:`shared_store` finds it."""
    return os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{shared_store() / STORE_FILE}"


def standard_tags(run_dir: Path) -> dict[str, str]:
    """MLflow's own tags for where a run comes from (source name and type, git commit, user:
    what its UI shows and filters on), and the run directory."""
    from mlflow.tracking.context.registry import resolve_tags

    return {**resolve_tags(), RUN_DIR_TAG: str(Path(run_dir).resolve())}


def flatten_params(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested dict -> ``{"train.lr": "0.0003", ...}`` for :meth:`Tracker.log_params`.

    ``prefix`` is prepended as a dotted path (``prefix="train"`` gives ``train.lr``).
    Strings are kept as they are; lists, tuples, numbers and booleans are JSON-encoded
    (``[1, 2]``, ``true``), ``None`` becomes ``null`` and an empty dict ``{}``, so that
    no key silently disappears. Values longer than MLflow's param limit are truncated
    with a marker saying so.
    """
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, name))
        else:
            flat[name] = _fit(_param_text(value), MAX_PARAM_VAL_LENGTH)
    return flat


def _param_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float, list, tuple, dict)) or value is None:
        return json.dumps(value, default=str)  # default=str: Paths and the like inside lists
    return str(value)


def _fit(text: str, limit: int) -> str:
    """MLflow rejects longer values outright; a truncated value beats a crashed run."""
    if len(text) <= limit:
        return text
    marker = f"...[truncated from {len(text)} chars]"
    return text[: limit - len(marker)] + marker


def _now_ms() -> int:
    return int(time.time() * MS_PER_SECOND)


def _quiet_migration_logs() -> None:
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in SILENCED_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _same_uri(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _read_record(path: Path) -> dict[str, str] | None:
    """The recorded run, or None when this run directory has none yet."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read the recorded MLflow run ({err}); restore the file, "
                        "or delete it to start a new MLflow run") from None
    missing = [key for key in RECORD_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)}; restore the file, "
                        "or delete it to start a new MLflow run")
    return record


def _check_local_store_exists(uri: str, record_path: Path) -> None:
    """SQLite would silently create an empty store at a stale path (a moved run directory)."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite" and not Path(parsed.path).exists():
        raise UserError(f"{record_path}: the recorded tracking store {uri} does not exist; if the "
                        "run directory was moved, edit tracking_uri in that file to the new path")


class Tracker:
    """One MLflow run per training run (not one per rank): only rank 0 creates a Tracker.

    Uses an explicit ``MlflowClient`` (no fluent ``mlflow.start_run`` global state), so
    several trackers can coexist in one process. ``MlflowClient.log_batch`` splits its
    input into requests within MLflow's per-request limits (100 params or tags, 1000
    metrics), so the methods below pass whole dicts in one call.
    """

    def __init__(self, client: MlflowClient, run_id: str, tracking_uri: str,
                 experiment_id: str) -> None:
        """Use :meth:`open`; this only binds an existing run."""
        self.client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id

    @classmethod
    def open(cls, run_dir: Path, *, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT,
             run_name: str | None = None, wait_s: float = REACHABLE_WAIT_S) -> Tracker:
        """Create the MLflow run, or resume the one recorded in ``run_dir/mlflow_run.json``.

        ``tracking_uri=None`` means the URI recorded in that file, else
        :func:`default_tracking_uri`. Resuming with a different URI than the recorded one
        raises :class:`UserError` (it must not silently fork the run), as does a recorded
        run id the store does not know. ``experiment`` and ``run_name`` only apply when
        creating: a resumed run stays where it was created.
        """
        _quiet_migration_logs()
        fail_fast_http()
        run_dir = Path(run_dir)
        record_path = RunLayout(run_dir).mlflow_record
        record = _read_record(record_path)
        check_reachable(tracking_uri or (record or {}).get("tracking_uri") or default_tracking_uri(), wait_s)
        if record is not None:
            return cls._resume(record, record_path, tracking_uri)
        return cls._create(run_dir, tracking_uri, experiment, run_name)

    @classmethod
    def attach(cls, run_dir: Path, *, wait_s: float = REACHABLE_WAIT_S) -> Tracker | None:
        """The run recorded in ``run_dir`` with its status unchanged, or None when there is
        none: later stages (export, evaluation) add artifacts to the training's run."""
        _quiet_migration_logs()
        fail_fast_http()
        record_path = RunLayout(run_dir).mlflow_record
        record = _read_record(record_path)
        if record is None:
            return None
        check_reachable(record["tracking_uri"], wait_s)
        return cls._resume(record, record_path, None, mark_running=False)

    @classmethod
    def _resume(cls, record: dict[str, str], record_path: Path,
                tracking_uri: str | None, *, mark_running: bool = True) -> Tracker:
        recorded_uri = record["tracking_uri"]
        if tracking_uri is not None and not _same_uri(tracking_uri, recorded_uri):
            raise UserError(
                f"{record_path} records tracking URI {recorded_uri} but {tracking_uri} was given; "
                f"resume with {recorded_uri} (or no tracking URI), or use a new run directory "
                "to start a new MLflow run")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        _check_local_store_exists(recorded_uri, record_path)
        client = MlflowClient(tracking_uri=recorded_uri)
        run_id = record["run_id"]
        try:
            run = client.get_run(run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise UserError(f"{record_path}: MLflow run {run_id} does not exist at {recorded_uri}; "
                            "delete the file to start a new MLflow run") from None
        if mark_running:
            client.update_run(run_id, status="RUNNING")
        return cls(client, run_id, recorded_uri, run.info.experiment_id)

    @classmethod
    def _create(cls, run_dir: Path, tracking_uri: str | None, experiment: str,
                run_name: str | None) -> Tracker:
        from mlflow.tracking import MlflowClient

        run_dir.mkdir(parents=True, exist_ok=True)
        uri = tracking_uri or default_tracking_uri()
        shared = f"sqlite:///{shared_store() / STORE_FILE}"
        if uri == shared:
            shared_store().mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=uri)
        # The shared local store keeps artifacts next to it; a server decides its own.
        artifacts = (shared_store() / ARTIFACTS_DIR).as_uri() if uri == shared else None
        experiment_id = _experiment_id(client, experiment, artifacts)
        run = client.create_run(experiment_id, run_name=run_name or run_dir.resolve().name,
                                tags=standard_tags(run_dir))
        record = dict(tracking_uri=uri, run_id=run.info.run_id, experiment_id=experiment_id)
        atomic_write_bytes(RunLayout(run_dir).mlflow_record, (json.dumps(record, indent=2) + "\n").encode())
        return cls(client, run.info.run_id, uri, experiment_id)

    def log_params(self, params: dict[str, str]) -> None:
        """Log params once; re-logging the same value (a resumed run) is a no-op.

        A param logged before with a different value raises :class:`UserError`: a resumed
        run whose config changed is a different experiment.
        """
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        logged = self.client.get_run(self.run_id).data.params
        new = []
        for key, value in params.items():
            value = _fit(str(value), MAX_PARAM_VAL_LENGTH)
            if key not in logged:
                new.append(Param(key, value))
            elif logged[key] != value:
                raise UserError(
                    f"param {key} was {logged[key]!r} in MLflow run {self.run_id} and is now "
                    f"{value!r}; resume with the original value, or start a new run directory")
        if new:
            self.client.log_batch(self.run_id, params=new)

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Log all metrics of one step in one batch; NaN and inf are logged as they are.
        ``timestamp_ms``: when they were measured (default now), for late delivery."""
        from mlflow.entities import Metric

        timestamp = _now_ms() if timestamp_ms is None else timestamp_ms
        batch = [Metric(key, float(value), timestamp, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_metric_points(self, points: list[Metric]) -> None:
        """Log metric points of any steps, with their own timestamps, in one request
        (``MlflowClient.log_batch`` splits what exceeds MLflow's per-request limits)."""
        self.client.log_batch(self.run_id, metrics=points)

    def logged_steps_after(self, step: int) -> dict[str, set[int]]:
        """For each metric of the run, the steps after ``step`` it already holds: what a run
        resumed from checkpoint ``step`` must not log a second time."""
        keys = self.client.get_run(self.run_id).data.metrics
        logged = {key: {m.step for m in self.client.get_metric_history(self.run_id, key) if m.step > step}
                  for key in keys}
        return {key: steps for key, steps in logged.items() if steps}

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set (or overwrite) run tags; over-long values are truncated with a marker."""
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        batch = [RunTag(key, _fit(str(value), MAX_TAG_VAL_LENGTH)) for key, value in tags.items()]
        self.client.log_batch(self.run_id, tags=batch)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        path = Path(path)
        if not path.exists():
            raise UserError(f"artifact {path} does not exist; check the path")
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file`` (e.g. ``config/resolved.yaml``)."""
        self.client.log_text(self.run_id, text, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run terminated: FINISHED, FAILED or KILLED."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, not {status!r}")
        self.client.set_terminated(self.run_id, status)

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs sorted by step (then logging time), for reports and tests."""
        history = self.client.get_metric_history(self.run_id, key)
        ordered = sorted(history, key=lambda metric: (metric.step, metric.timestamp))
        return [(metric.step, metric.value) for metric in ordered]


def _experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, artifact_location=artifact_location)
    if experiment.lifecycle_stage == "deleted":
        restore = f"mlflow experiments restore --experiment-id {experiment.experiment_id}"
        raise UserError(f"MLflow experiment {name!r} is deleted at {client.tracking_uri}; "
                        f"restore it ({restore}) or choose another experiment name")
    return experiment.experiment_id

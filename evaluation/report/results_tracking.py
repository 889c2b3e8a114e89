"""The MLflow record of an evaluation, best effort: a tracking server that is down or failing
costs that record (a warning), never the results nor the report.

    tracking = track_results(results, run_dir=run_dir, out_dir=out_dir, tracking_uri=None)
    if tracking is not None:
        tracking.record, tracking.curves   # the run (for results.json), the training curves
        tracking.upload_report(out_dir)    # once the report is written

``track_results`` logs ``unmask eval``'s metrics (``eval/...``) at the checkpoint's step to the
training's own MLflow run when the export belongs to one, or, with a tracking URI, to a new run
in the ``unmask-eval`` experiment tagged with the checkpoint; ``track_downstream`` logs
``unmask lm-eval``'s (``lm_eval/TASK/METRIC``) to the same run. A dataset or task is named by
any file name: ``metric_part`` makes it a name every MLflow server takes, distinct from the
others, so one odd name never costs the record. What is logged, and why some are tags:
docs/evaluation.md#the-report and docs/downstream.md.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from evaluation.report.plots import Curves
from evaluation.report.write import JSON_NAME
from evaluation.results import (
    DOWNSTREAM_JSON,
    DownstreamResults,
    EvalResults,
    MlflowRecord,
    ModelRecord,
    SamplingRecord,
    ScheduleRecord,
)
from pipeline.tracking.tracker import Tracker, flatten_params, tracking_failures

__all__ = ["CURVE_METRICS", "DOWNSTREAM_PREFIX", "EVAL_EXPERIMENT", "REPORT_ARTIFACT_DIR", "VAL_METRIC",
           "EvalTracking", "downstream_metrics", "metric_part", "metric_parts", "track_downstream", "track_results"]

log = logging.getLogger("unmask.eval")

VAL_METRIC = "val/nelbo_per_token"   # the training's validation bound, as it logs it
CURVE_METRICS = ("train/loss", VAL_METRIC)
EVAL_EXPERIMENT = "unmask-eval"
REPORT_ARTIFACT_DIR = "report"
DOWNSTREAM_PREFIX = "lm_eval"
# lm-eval's filters ("none", "strict-match", ...): "none" is left out of the metric's name.
NO_FILTER = "none"
# What a part of a metric's name may hold: ASCII letters, digits, _ - . and spaces, which every
# MLflow server takes (colons are refused on Windows, other letters by some stores); anything
# else becomes _. "/" separates the parts.
_UNSAFE_IN_PART = re.compile(r"[^A-Za-z0-9_\-. ]")
# The longest part kept as it is; a longer one keeps its start and a digest of the whole. Two
# parts and their prefix and suffix stay below MLflow's 250 characters (MAX_ENTITY_KEY_LENGTH).
MAX_NAME_PART = 100
DIGEST_CHARS = 8


def _with_digest(part: str, text: str) -> str:
    return f"{part[:MAX_NAME_PART - DIGEST_CHARS - 1]}_{hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]}"


def metric_part(text: str) -> str:
    """``text`` (a dataset's or a task's name: any file name) as one part of a metric's name
    that MLflow takes: each unsafe character becomes _; a part that is only dots (which MLflow
    reads as a path: "eval/../x" is "x") or is longer than ``MAX_NAME_PART`` keeps its start
    and a digest of ``text``."""
    part = _UNSAFE_IN_PART.sub("_", text)
    if not part.strip("."):
        return _with_digest("", text)
    return part if len(part) <= MAX_NAME_PART else _with_digest(part, text)


def metric_parts(texts: Iterable[str]) -> dict[str, str]:
    """``{text: metric_part(text)}``, distinct: texts whose parts would meet (``a(b)`` and
    ``a)b(``) each get a digest of their own text."""
    parts = {text: metric_part(text) for text in texts}
    counts = Counter(parts.values())
    return {text: part if counts[part] == 1 else _with_digest(part, text) for text, part in parts.items()}


def _first_clause(err: BaseException) -> str:
    # MLflow's messages go on for lines; the first clause says what happened.
    return str(err).split("; ")[0]


@dataclass(frozen=True)
class EvalTracking:
    """The MLflow run that took an evaluation's metrics, and the training curves it holds."""

    tracker: Tracker
    curves: Curves | None   # metric -> (step, value) points; None when it holds none

    @property
    def record(self) -> MlflowRecord:
        """The run, as results.json records it."""
        return MlflowRecord(tracking_uri=self.tracker.tracking_uri, run_id=self.tracker.run_id)

    def upload_report(self, out_dir: Path) -> None:
        """The report directory as the run's ``report`` artifact; a failure costs a warning."""
        try:
            self.tracker.log_artifact(out_dir, artifact_path=REPORT_ARTIFACT_DIR)
        except tracking_failures() as err:
            log.warning("MLflow: the report was not uploaded (%s)", _first_clause(err))


def _tracker(run_dir: Path | None, out_dir: Path, tracking_uri: str | None, model: ModelRecord) -> Tracker:
    """The training's MLflow run when known; else a new run (tagged with the checkpoint)."""
    tracker = Tracker.attach(run_dir) if run_dir is not None and tracking_uri is None else None
    if tracker is None:
        tracker = Tracker.open(out_dir, tracking_uri=tracking_uri, experiment=EVAL_EXPERIMENT)
        tracker.set_tags({"checkpoint": model.path, "step": str(model.step)})
    return tracker


def _log_schedule(tracker: Tracker, schedule: ScheduleRecord, step: int) -> None:
    """A learned schedule's spread as metrics, and the tokens that unmask first and last as tags."""
    tracker.log_metrics({f"eval/schedule/{key}": getattr(schedule, key)
                         for key in ("exponent_min", "exponent_median", "exponent_max")}, step)
    tracker.set_tags({f"eval/schedule/{order}": " ".join(repr(token.text) for token in getattr(schedule, order))
                      for order in ("unmask_first", "unmask_last")})


def _log_sampling(tracker: Tracker, sampling: SamplingRecord, step: int) -> None:
    """The samples' mean unigram entropy and network calls, their generative perplexity when
    there is a reference, and the plan that drew them (tags)."""
    metrics = {"eval/samples/mean_unigram_entropy": sampling.mean_unigram_entropy,
               "eval/samples/mean_network_calls": sampling.mean_network_calls}
    if sampling.generative_perplexity:
        metrics["eval/samples/generative_perplexity"] = sampling.generative_perplexity.perplexity
    tracker.log_metrics(metrics, step)
    plan = flatten_params(sampling.plan.to_dict())   # {"sampler": ..., "options.eta": ...}
    tracker.set_tags({f"eval/sampling/{key}": value for key, value in plan.items()})


def _log_metrics(tracker: Tracker, results: EvalResults) -> None:
    step = results.model.step or 0
    if results.protocol.block_size:  # block diffusion: which L' these bounds are for
        tracker.set_tags({"eval/block_size": str(results.protocol.block_size)})
    if results.schedule:
        _log_schedule(tracker, results.schedule, step)
    if results.sampling:
        _log_sampling(tracker, results.sampling, step)
    parts = metric_parts(results.datasets)
    renamed = {f"eval/{part}/dataset": name for name, part in parts.items() if part != name}
    if renamed:  # a dataset whose name had to change is found by its tag: eval/PART/dataset = its name
        tracker.set_tags(renamed)
    metrics = {}
    for name, record in results.datasets.items():
        key = parts[name]
        metrics.update({f"eval/{key}/nelbo_per_token": record.nelbo_per_token,
                        f"eval/{key}/perplexity_bound": record.perplexity_bound,
                        f"eval/{key}/bits_per_byte": record.bits_per_byte,
                        f"eval/{key}/standard_error": record.standard_error})
    tracker.log_metrics(metrics, step)


def downstream_metrics(downstream: DownstreamResults) -> dict[str, float]:
    """The MLflow metrics of ``unmask lm-eval``'s tasks (module docstring)."""
    metrics: dict[str, float] = {}
    tasks = metric_parts(downstream.tasks)
    for task, record in downstream.tasks.items():
        prefix = f"{DOWNSTREAM_PREFIX}/{tasks[task]}"
        for key, (value, error) in record.values().items():
            name, _, where = key.partition(",")
            name = metric_part(name if where in ("", NO_FILTER) else f"{name}_{where}")
            metrics[f"{prefix}/{name}"] = value
            if error is not None:
                metrics[f"{prefix}/{name}_stderr"] = error
        if record.mean_log_likelihood is not None:
            metrics[f"{prefix}/mean_log_likelihood"] = record.mean_log_likelihood
            metrics[f"{prefix}/monte_carlo_error"] = record.monte_carlo_error
    return metrics


def _track(model: ModelRecord, log_to: Callable[[Tracker], None], *, run_dir: Path | None, out_dir: Path,
           tracking_uri: str | None, record_file: str) -> EvalTracking | None:
    """Open the run, log with ``log_to`` and fetch the training curves; None, with a warning
    naming ``record_file`` (where the numbers stay), when the tracking server fails."""
    try:
        tracker = _tracker(run_dir, out_dir, tracking_uri, model)
        log_to(tracker)
        curves = {key: tracker.metric_history(key) for key in CURVE_METRICS}
    except tracking_failures() as err:
        log.warning("MLflow: the results were not logged (%s); they are in %s", _first_clause(err),
                    out_dir / record_file)
        return None
    return EvalTracking(tracker, {key: points for key, points in curves.items() if points} or None)


def track_results(results: EvalResults, *, run_dir: Path | None, out_dir: Path,
                  tracking_uri: str | None) -> EvalTracking | None:
    """Log the metrics of ``results`` and fetch the training curves, when the server answers.

    ``run_dir``: the training run of the evaluated export (None for a standalone export);
    ``tracking_uri``: log to a new run there instead of the training's. None, with a warning,
    when the tracking server is down or failing: the results in ``out_dir`` stand without it.
    """
    return _track(results.model, lambda tracker: _log_metrics(tracker, results), run_dir=run_dir,
                  out_dir=out_dir, tracking_uri=tracking_uri, record_file=JSON_NAME)


def track_downstream(downstream: DownstreamResults, *, run_dir: Path | None, out_dir: Path,
                     tracking_uri: str | None) -> EvalTracking | None:
    """``track_results`` for ``unmask lm-eval``'s tasks: the same run, their metrics at the
    checkpoint's step."""
    metrics = downstream_metrics(downstream)
    return _track(downstream.model, lambda tracker: tracker.log_metrics(metrics, downstream.model.step or 0),
                  run_dir=run_dir, out_dir=out_dir, tracking_uri=tracking_uri, record_file=DOWNSTREAM_JSON)

"""The results of ``unmask lm-eval``, typed: what ``downstream.json`` holds beside lm-eval's own
results file, and what the report's "Downstream tasks" section and MLflow show.

    results = DownstreamResults.read(Path("runs/tiny/report/downstream.json"))
    results.tasks["lambada_openai"].metrics["acc,none"], results.settings["samples"]

As JSON (``evaluation.results`` reads the model record; every key is written)::

    {"model": ModelRecord,                      # the export scored (evaluation.results)
     "tasks": {TASK: {"metrics": {"acc,none": float, "acc_stderr,none": float | "N/A", ...},  # lm-eval's, verbatim
                      "higher_is_better": {"acc": bool, ...},
                      "documents": int, "documents_total": int,   # scored (after --limit) and in the task
                      "requests": int,                            # loglikelihood requests scored
                      "mean_log_likelihood": float | None,        # per request, nats (None: no such requests)
                      "monte_carlo_error": float | None,          # of mean_log_likelihood (0: exact)
                      "median_request_error": float | None,       # the median request's own error
                      "truncated_contexts": int}},                # requests whose context was cut on the left
     "settings": {...},                          # tasks, limit, samples K, seed, batch size, device, ...
     "lm_eval_version": str, "lm_eval_results": str,   # the name of lm-eval's results file beside it
     "mlflow": {"tracking_uri": str, "run_id": str} | None,
     "created": ISO 8601 str, "unmask_version": str, "git_commit": str}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from evaluation.records import Record, read_checked
from evaluation.results import MlflowRecord, ModelRecord

__all__ = ["DOWNSTREAM_JSON", "LM_EVAL_JSON", "DownstreamResults", "TaskResult"]

DOWNSTREAM_JSON = "downstream.json"
LM_EVAL_JSON = "lm_eval_results.json"   # lm-eval's own results, beside downstream.json


@dataclass(frozen=True, kw_only=True)
class TaskResult(Record):
    """One lm-eval task: its metrics as lm-eval reports them, and our Monte Carlo record."""

    metrics: dict[str, Any]              # lm-eval's keys ("acc,none", "acc_stderr,none", ...), verbatim
    higher_is_better: dict[str, bool]
    documents: int
    documents_total: int
    requests: int = 0
    mean_log_likelihood: float | None = None
    monte_carlo_error: float | None = None
    median_request_error: float | None = None
    truncated_contexts: int = 0

    def values(self) -> dict[str, tuple[float, float | None]]:
        """metric[,filter] -> (value, lm-eval's standard error over documents or None): the
        numeric metrics only, without their ``_stderr`` companions."""
        out = {}
        for key, value in self.metrics.items():
            name, _, where = key.partition(",")
            if name.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            error = self.metrics.get(f"{name}_stderr,{where}" if where else f"{name}_stderr")
            out[key] = (float(value), float(error) if isinstance(error, (int, float)) else None)
        return out


@dataclass(frozen=True, kw_only=True)
class DownstreamResults(Record):
    """Everything ``unmask lm-eval`` found out and how; written as ``downstream.json``."""

    model: ModelRecord
    tasks: dict[str, TaskResult]
    settings: dict[str, Any] = field(default_factory=dict)
    lm_eval_version: str
    lm_eval_results: str
    mlflow: MlflowRecord | None = None
    created: str
    unmask_version: str
    git_commit: str

    @classmethod
    def from_json(cls, data: Any) -> DownstreamResults:
        """Read a downstream.json object; a ValueError names every key it lacks."""
        return read_checked(cls, data, what="downstream results", schema="evaluation.downstream.task_results",
                            redo="rerun `unmask lm-eval` to write them anew")

    def with_mlflow(self, record: MlflowRecord | None) -> DownstreamResults:
        return replace(self, mlflow=record)

    def dumps(self) -> str:
        """The text of downstream.json: indented, keys sorted, UTF-8 as is."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> DownstreamResults:
        """A downstream.json file; ValueError when it is not one (OSError when it cannot be read)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))

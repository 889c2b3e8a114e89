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
from typing import Any, ClassVar

from evaluation.results import MlflowRecord, ModelRecord

__all__ = ["DOWNSTREAM_JSON", "LM_EVAL_JSON", "DownstreamResults", "TaskResult"]

DOWNSTREAM_JSON = "downstream.json"
LM_EVAL_JSON = "lm_eval_results.json"   # lm-eval's own results, beside downstream.json


@dataclass(frozen=True, kw_only=True)
class TaskResult:
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

    KEYS: ClassVar[tuple[str, ...]] = ("metrics", "higher_is_better", "documents", "documents_total", "requests",
                                       "mean_log_likelihood", "monte_carlo_error", "median_request_error",
                                       "truncated_contexts")

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskResult:
        return cls(**{key: data[key] for key in cls.KEYS})

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
class DownstreamResults:
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

    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "tasks", "settings", "lm_eval_version", "lm_eval_results",
                                           "mlflow", "created", "unmask_version", "git_commit")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model.to_json(), "tasks": {name: task.to_json() for name, task in self.tasks.items()},
                "settings": dict(self.settings), "lm_eval_version": self.lm_eval_version,
                "lm_eval_results": self.lm_eval_results, "mlflow": self.mlflow.to_json() if self.mlflow else None,
                "created": self.created, "unmask_version": self.unmask_version, "git_commit": self.git_commit}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DownstreamResults:
        """Read a downstream.json object; ValueError naming what it lacks."""
        missing = [key for key in cls.REQUIRED if not isinstance(data, dict) or key not in data]
        if isinstance(data, dict) and isinstance(data.get("tasks"), dict):
            missing += [f"tasks.{name}.{key}" for name, task in data["tasks"].items()
                        for key in TaskResult.KEYS if not isinstance(task, dict) or key not in task]
        missing += ModelRecord.missing(data.get("model"), "model.") if isinstance(data, dict) and "model" in data else []
        if missing:
            raise ValueError(f"downstream results lack {', '.join(missing)} (see evaluation.downstream.task_results)")
        return cls(model=ModelRecord.from_json(data["model"]),
                   tasks={name: TaskResult.from_json(task) for name, task in data["tasks"].items()},
                   settings=dict(data["settings"]), lm_eval_version=data["lm_eval_version"],
                   lm_eval_results=data["lm_eval_results"],
                   mlflow=None if data["mlflow"] is None else MlflowRecord.from_json(data["mlflow"]),
                   created=data["created"], unmask_version=data["unmask_version"], git_commit=data["git_commit"])

    def with_mlflow(self, record: MlflowRecord | None) -> DownstreamResults:
        return replace(self, mlflow=record)

    def dumps(self) -> str:
        """The text of downstream.json: indented, keys sorted, UTF-8 as is."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> DownstreamResults:
        """A downstream.json file; ValueError when it is not one (OSError when it cannot be read)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))

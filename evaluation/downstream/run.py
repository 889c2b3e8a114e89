"""Downstream tasks through lm-evaluation-harness, end to end: the library behind ``unmask lm-eval``.

    config = DownstreamConfig(tasks=("lambada_openai_local", "ptb_word_order"), data_dir="../shared/data")
    report = run_downstream(Path("runs/tiny"), config, DownstreamOptions())
    report.results.tasks["ptb_word_order"].metrics["acc,none"], report.files.markdown

In order: every argument is checked before any work (the flags, the report's directory, the
user's task YAMLs: ``evaluation.downstream.task_yamls``, and with ``download`` that the Hub
answers); a training run without an export is exported first; the tasks are looked up (ours
and ``include_path`` first, lm-eval's own only for the names left), and an unknown name or
unreadable data is refused before the model is loaded; lm-eval scores them with the ``unmask``
model (``evaluation.downstream.lm_eval_model``); ``lm_eval_results.json``, ``downstream.json``
(``evaluation.results``) and the report are written into the report directory, the metrics
logged to the MLflow run of the bounds. lm-eval runs offline unless ``download``
(``hub_offline``). See docs/downstream.md.
"""

from __future__ import annotations

import datetime
import difflib
import json
import logging
import math
import os
import socket
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from common.errors import UserError
from common.provenance import git_commit, package_version
from evaluation.downstream.likelihoods import GUIDED_SCORES
from evaluation.downstream.task_yamls import check_task_yamls, task_yaml_paths
from evaluation.downstream.tasks import TASKS_DIR
from evaluation.inference import resolve_device
from evaluation.report.results_tracking import track_downstream
from evaluation.report.write import JSON_NAME, ReportFiles, read_record, write_report
from evaluation.results import LM_EVAL_JSON, DownstreamResults, EvalResults, TaskResult
from evaluation.zero_shot import ReportOptions, check_report_dir, model_record, report_dir
from model.sampling import MAX_STEPS
from pipeline.interchange.export import training_run_of
from pipeline.interchange.run_export import choose_export

__all__ = ["DownstreamConfig", "DownstreamOptions", "DownstreamReport", "check_hub_reachable", "hub_offline",
           "run_downstream"]

log = logging.getLogger("unmask.lm_eval")

OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
# The offline switches of the Hugging Face libraries, read from the environment at import.
OFFLINE_CONSTANTS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                     ("datasets.config", "HF_DATASETS_OFFLINE"))
# lm-eval advises every task with a custom_dataset to pass its keywords with --metadata, which
# unmask lm-eval does (--data-dir): that warning says nothing to its users.
_CUSTOM_DATASET_ADVICE = "Custom kwargs can be passed to `--metadata`"
TASK_SUGGESTIONS = 3
AUTO = "auto"
HUB_ENDPOINT = "https://huggingface.co"   # huggingface_hub's default, unless HF_ENDPOINT
HUB_PROBE_TIMEOUT_S = 10                   # one TCP connection; the libraries' retries take a minute
# Errors (by class name, anywhere in the chain) of a dataset neither on disk nor in the cache
# while offline: downloading it is the cure.
_HUB_ERRORS = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError")


@dataclass(frozen=True)
class DownstreamConfig:
    """What ``unmask lm-eval`` scores, and how (recorded in ``downstream.json``'s settings)."""

    tasks: tuple[str, ...]
    include_path: tuple[str, ...] = ()   # directories of the user's own task YAMLs
    data_dir: str | None = None          # the ../shared/data layout, for the local tasks
    limit: float | None = None           # lm-eval's: the first N documents (a fraction when < 1)
    num_fewshot: int | None = None       # None: each task's own (zero-shot for ours)
    samples: int = 16                    # K: time samples per loglikelihood request
    seed: int = 0
    batch_size: int | None = None        # rows per forward pass; None: by the device's capacity
    gen_sampler: str = "ancestral"       # how a diffusion model samples for generate_until (model.sampling)
    gen_steps: int | None = None         # its budget of network calls (None: one per generated token)
    gen_guidance: float | None = None    # unsupervised guidance towards the context (docs/fast-generation.md)
    gen_block_len: int | None = None     # semi-autoregressive blocks of generation (docs/fast-generation.md)
    gen_whole_sequence: bool = False     # each block's calls see the whole sequence
    gen_dual_cache: int | None = None    # with it: the dual cache, refreshed every N calls
    download: bool = False               # let lm-eval fetch datasets from the Hugging Face Hub
    allow_code: bool = False             # run the Python that the user's task YAMLs name (!function)
    guidance: float | None = None        # loglikelihood by guided logits: a ranking, not a bound (fast-generation.md)

    def check(self) -> None:
        """The flags, then the include paths: a UserError naming the flag."""
        checks = [("--tasks", bool(self.tasks), "name at least one task (e.g. lambada_openai_local)"),
                  ("--samples", self.samples >= 1, "must be >= 1"),
                  ("--seed", self.seed >= 0, "must be >= 0"),
                  ("--limit", self.limit is None or 0 < self.limit and (self.limit < 1
                                                                       or float(self.limit).is_integer()),
                   "must be a whole number of documents N >= 1, or a fraction in (0, 1)"),
                  ("--num-fewshot", self.num_fewshot is None or self.num_fewshot >= 0, "must be >= 0"),
                  ("--batch-size", self.batch_size is None or self.batch_size >= 1, "must be >= 1"),
                  ("--gen-steps", self.gen_steps is None or 1 <= self.gen_steps <= MAX_STEPS,
                   f"must lie in [1, {MAX_STEPS:,}] (model.sampling.MAX_STEPS)"),
                  ("--gen-guidance", self.gen_guidance is None or math.isfinite(self.gen_guidance)
                   and self.gen_guidance >= 0, "must be a number >= 0"),
                  ("--guidance", self.guidance is None or math.isfinite(self.guidance) and self.guidance >= 0,
                   "must be a number >= 0"),
                  ("--gen-block-len", self.gen_block_len is None or self.gen_block_len >= 1, "must be >= 1"),
                  ("--gen-dual-cache", self.gen_dual_cache is None or self.gen_dual_cache >= 1, "must be >= 1"),
                  ("--gen-whole-sequence", self.gen_block_len is not None or not self.gen_whole_sequence,
                   "needs --gen-block-len (blocks that see the whole sequence)"),
                  ("--gen-dual-cache", self.gen_whole_sequence or self.gen_dual_cache is None,
                   "needs --gen-whole-sequence (it caches the prefix and the masked suffix)")]
        for flag, ok, requirement in checks:
            if not ok:
                raise UserError(f"{flag} {requirement}")
        for path in self.include_path:
            if not Path(path).is_dir():
                raise UserError(f"--include-path {path}: not a directory; give a directory of lm-eval task YAMLs")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise UserError(f"--data-dir {self.data_dir}: not a directory; give the folder laid out as "
                            f"../shared/data (see its SOURCES.md)")

    def model_args(self, device: str) -> dict[str, Any]:
        """The ``unmask`` model's arguments (``evaluation.downstream.lm_eval_model``)."""
        return {"samples": self.samples, "seed": self.seed, "batch_size": self.batch_size or AUTO,
                "device": device, "gen_sampler": self.gen_sampler, "gen_steps": self.gen_steps,
                **({} if self.gen_guidance is None else {"gen_guidance": self.gen_guidance}),
                **({} if self.guidance is None else {"guidance": self.guidance}), **self.block_args()}

    def block_args(self) -> dict[str, Any]:
        """The generation's block arguments that are set."""
        values = {"gen_block_len": self.gen_block_len, "gen_whole_sequence": self.gen_whole_sequence,
                  "gen_dual_cache": self.gen_dual_cache}
        return {name: value for name, value in values.items() if value is not None and value is not False}


@dataclass(frozen=True)
class DownstreamOptions:
    """Where the outputs go and where the metrics are logged."""

    out: Path | None = None          # None: RUN/report, or EXPORT/report for a standalone export
    mlflow_uri: str | None = None    # None: the training's own MLflow run (a new run without one)
    device: str | None = None        # None: cuda when available, else cpu


@dataclass(frozen=True)
class DownstreamReport:
    """What ``run_downstream`` made: the results and the files it wrote."""

    results: DownstreamResults
    lm_eval_results: Path
    files: ReportFiles


# ------------------------------------------------------------------ offline and quiet
@contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """Within the block, the Hugging Face libraries make no network request (module docstring)."""
    if not enabled:
        yield
        return
    saved = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    patched = [(module, name, getattr(module, name)) for module, name in
               ((sys.modules.get(module_name), name) for module_name, name in OFFLINE_CONSTANTS) if module]
    os.environ.update({name: "1" for name in OFFLINE_VARIABLES})
    for module, name, _ in patched:
        setattr(module, name, True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for module, name, value in patched:
            setattr(module, name, value)


class _DropAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _CUSTOM_DATASET_ADVICE not in record.getMessage()


@contextmanager
def _lm_eval_logs() -> Iterator[None]:
    """lm-eval's warnings, not its progress chatter (its INFO lines) or its advice on --metadata."""
    logger, task_logger, advice = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.api.task"), _DropAdvice()
    level = logger.level
    logger.setLevel(logging.WARNING)
    task_logger.addFilter(advice)
    try:
        yield
    finally:
        logger.setLevel(level)
        task_logger.removeFilter(advice)


# ------------------------------------------------------------------ tasks
def _task_manager(config: DownstreamConfig):
    """lm-eval's TaskManager over our local tasks and ``include_path``, with lm-eval's own tasks
    only when a name needs them; every name checked (UserError: unknown, with suggestions)."""
    from lm_eval.tasks import TaskManager

    class CheckedTaskManager(TaskManager):
        """Task loading errors (a missing file, an unavailable dataset) as one UserError."""

        def load(self, task_list):
            try:
                return super().load(task_list)
            except UserError as err:
                raise UserError(f"--tasks {_names(task_list)}: {err}") from None
            except Exception as err:  # lm-eval and datasets raise anything from KeyError to ConnectionError
                log.debug("loading the tasks failed", exc_info=True)
                hint = "" if config.download or not _hub_is_the_cure(err) else (
                    " (unmask lm-eval runs offline: rerun with --download to let lm-eval fetch it from the Hugging "
                    "Face Hub)")
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
                raise UserError(f"--tasks {_names(task_list)}: lm-eval could not load the task: "
                                f"{type(err).__name__}: {first_line}{hint}") from None

    paths = [str(TASKS_DIR), *config.include_path]
    metadata = {"data_dir": str(Path(config.data_dir).resolve())} if config.data_dir else {}
    manager = CheckedTaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if not _unknown(manager, config.tasks):
        return manager
    manager = CheckedTaskManager(include_path=paths, metadata=metadata)
    unknown = _unknown(manager, config.tasks)
    if unknown:
        raise UserError("; ".join(_unknown_message(name, manager.all_tasks) for name in unknown)
                        + "; list the tasks with `python -m evaluation.downstream.lm_eval_model ls tasks`, or add "
                          "your own YAMLs with --include-path DIR")
    return manager


def _hub_is_the_cure(err: BaseException) -> bool:
    """Whether ``err`` says a dataset is neither on disk nor in the Hugging Face cache (offline)."""
    chain: BaseException | None = err
    while chain is not None:
        if type(chain).__name__ in _HUB_ERRORS:
            return True
        chain = chain.__cause__ or chain.__context__
    return False


def check_hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> None:
    """One TCP connection to the Hub's host, or to the proxy the environment names for it: a
    UserError naming ``--download`` when there is none (module docstring)."""
    endpoint = os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT
    parsed = urlparse(endpoint)
    proxy = None if urllib.request.proxy_bypass(parsed.hostname or "") else urllib.request.getproxies().get(
        parsed.scheme)
    target = urlparse(proxy) if proxy else parsed
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname or "", port), timeout=timeout).close()
    except OSError as err:
        raise UserError(f"--download: the Hugging Face Hub at {endpoint} cannot be reached ({err}); connect this "
                        f"machine to the network, or leave --download out to read the datasets on disk and in the "
                        f"Hugging Face cache") from None


def _names(task_list: Any) -> str:
    items = task_list if isinstance(task_list, (list, tuple)) else [task_list]
    return ",".join(str(item) if isinstance(item, str) else getattr(item, "task_name", type(item).__name__)
                    for item in items)


def _unknown(manager, names: Sequence[str]) -> list[str]:
    """The names that are no task, group, tag, glob pattern of them, or YAML file."""
    return [name for name in names
            if name not in manager.all_tasks and not manager.match_tasks([name]) and not Path(name).is_file()]


def _unknown_message(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=TASK_SUGGESTIONS)
    return f"--tasks: unknown task {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")


# ------------------------------------------------------------------ the records
def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _monte_carlo(records: list) -> dict[str, Any]:
    """A task's scored requests: their count, mean log-likelihood and its Monte Carlo error
    (from the replicate totals, as the estimator's), the median request's error, truncations."""
    if not records:
        return {}
    replicates = np.stack([record.score.replicates for record in records])   # [requests, K]
    per_replicate = replicates.mean(axis=0)
    errors = np.array([record.score.standard_error for record in records])
    if not errors.any():  # exact (autoregressive)
        error = 0.0
    else:
        error = float(per_replicate.std(ddof=1)) / math.sqrt(len(per_replicate)) if len(per_replicate) > 1 else math.nan
    return {"requests": len(records), "mean_log_likelihood": float(per_replicate.mean()),
            "monte_carlo_error": _finite(error), "median_request_error": _finite(float(np.median(errors))),
            "truncated_contexts": sum(record.score.context_dropped > 0 for record in records)}


def _task_results(results: dict[str, Any], records: list) -> dict[str, TaskResult]:
    by_task: dict[str, list] = defaultdict(list)
    for record in records:
        by_task[record.task].append(record)
    tasks = {}
    for name, metrics in results["results"].items():
        counts = results.get("n-samples", {}).get(name, {})
        documents = int(metrics.get("sample_len", counts.get("effective", 0)))
        tasks[name] = TaskResult(
            metrics={key: value for key, value in metrics.items() if "," in key},
            higher_is_better=dict(results.get("higher_is_better", {}).get(name, {})),
            documents=documents, documents_total=int(counts.get("original", documents)),
            **_monte_carlo(by_task.get(name, [])))
    return tasks


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _settings(config: DownstreamConfig, device: str) -> dict[str, Any]:
    return {"tasks": list(config.tasks), "include_path": [str(Path(p).resolve()) for p in config.include_path],
            "data_dir": None if config.data_dir is None else str(Path(config.data_dir).resolve()),
            "limit": config.limit, "num_fewshot": config.num_fewshot, "samples": config.samples,
            "seed": config.seed, "batch_size": config.batch_size or AUTO, "device": device,
            "precision": "bf16" if device.startswith("cuda") else "fp32", "gen_sampler": config.gen_sampler,
            "gen_steps": config.gen_steps, **({} if config.gen_guidance is None else {"gen_guidance": config.gen_guidance}),
            "offline": not config.download, "allow_code": config.allow_code, **config.block_args(),
            **({} if config.guidance is None else {"guidance": config.guidance, "loglikelihood": GUIDED_SCORES})}


def _check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("unmask lm-eval needs lm-evaluation-harness: pip install -e \".[lm-eval]\" "
                        "(make install does)")


# ------------------------------------------------------------------ the entry point
def run_downstream(target: Path, config: DownstreamConfig, options: DownstreamOptions) -> DownstreamReport:
    """Score ``target`` (a training run, exported first if needed, or an export) on the tasks of
    ``config`` with lm-evaluation-harness and write the outputs (module docstring). What
    the user can fix raises UserError, before any work when it can be known then."""
    target = Path(target)
    config.check()
    _check_installed()
    check_report_dir(target, options.out)
    check_task_yamls(config.include_path, task_yaml_paths(config.tasks), allow_code=config.allow_code)
    if config.download:
        check_hub_reachable()
    device = str(resolve_device(options.device))
    with hub_offline(not config.download), _lm_eval_logs():
        import lm_eval
        from lm_eval.utils import handle_non_serializable

        from evaluation.downstream.lm_eval_model import UnmaskLM

        manager = _task_manager(config)
        export_dir = choose_export(target, refresh=True)  # a run's newest checkpoint, exported if need be
        model = UnmaskLM(path=export_dir, **config.model_args(device))
        results = lm_eval.simple_evaluate(model=model, tasks=list(config.tasks), task_manager=manager,
                                          limit=config.limit, num_fewshot=config.num_fewshot, log_samples=False)
    out_dir = report_dir(target, ReportOptions(out=options.out))
    record = DownstreamResults(
        model=model_record(export_dir, model.exported), tasks=_task_results(results, model.records),
        settings=_settings(config, device), lm_eval_version=package_version("lm_eval"), lm_eval_results=LM_EVAL_JSON,
        created=_now(), unmask_version=package_version("unmask"), git_commit=git_commit())
    tracking = track_downstream(record, run_dir=training_run_of(export_dir), out_dir=out_dir,
                                tracking_uri=options.mlflow_uri)
    record = record.with_mlflow(tracking.record if tracking is not None else None)
    lm_eval_json = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    # The bounds `unmask eval` wrote into this directory stay in the report.
    files = write_report(read_record(out_dir / JSON_NAME, EvalResults.read), out_dir,
                         curves=tracking.curves if tracking else None, downstream=record,
                         lm_eval_results=lm_eval_json.encode("utf-8"))
    if tracking is not None:
        tracking.upload_report(out_dir)
    return DownstreamReport(record, out_dir / LM_EVAL_JSON, files)

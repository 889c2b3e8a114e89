"""Every file and folder of a run directory, named in one place (docs/training.md: "Run directory").

A run directory is what ``unmask train`` writes, what ``unmask export`` and ``unmask eval``
add to, and what ``unmask run`` fills stage by stage:

    RUN/config.json               the resolved training config
    RUN/metrics.jsonl             every logged metric (rank 0)
    RUN/train.lock                the lock of the trainer running now
    RUN/tokenizer/                the tokenizer of the data
    RUN/checkpoints/step-N/       checkpoints; RUN/checkpoints/latest names the newest
    RUN/mlflow_run.json           the MLflow run this training logs to (its store is shared:
                                  pipeline.tracking.tracker)
    RUN/export/                   model.safetensors, config.json, tokenizer/
    RUN/export-hf/                the same model for transformers (unmask export --format hf)
    RUN/report/                   report.md, report.html, results.json, plots
    RUN/ray_train/                Ray Train's records (--launcher ray without --storage)
    RUN/data/, RUN/corpus/, RUN/run_summary.json   what `unmask run` adds
    RUN/.unmask-output.json       marks the directory as a run (``RUN_KIND``, common.outputs)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from common.outputs import InputPath, OutputKind, entry_names, holds_only, json_object, read_marker

__all__ = ["MLFLOW_RECORD", "RUN_KIND", "RunLayout", "step_tag", "training_data", "TAG_PATTERN"]

TAG_PATTERN = re.compile(r"^step-(\d{8})$")
# The MLflow run a directory logs to: a training run's, or a report's own (pipeline.tracking.tracker).
MLFLOW_RECORD = "mlflow_run.json"


def step_tag(step: int) -> str:
    """The name of checkpoint ``step``'s directory."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class RunLayout:
    """The paths of the run directory ``root`` (nothing is created or read here)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # ------------------------------------------------------------------ training
    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def lock(self) -> Path:
        return self.root / "train.lock"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        """The file naming the newest complete checkpoint."""
        return self.checkpoints / "latest"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_tag(step)

    @property
    def ray_train(self) -> Path:
        return self.root / "ray_train"

    def before_first_step(self) -> tuple[Path, ...]:
        """What `unmask train` writes before its first step (nothing worth keeping yet)."""
        return (self.lock, self.config, self.tokenizer, self.metrics, self.mlflow_record, self.checkpoints)

    def entry_names(self) -> set[str]:
        """Every name a run directory holds at its top (the module docstring's)."""
        paths = (self.config, self.metrics, self.lock, self.tokenizer, self.checkpoints, self.ray_train,
                 self.mlflow_record, self.export, self.hf_export, self.report, self.data, self.corpus, self.summary)
        return {path.name for path in paths}

    def is_training_run(self) -> bool:
        """Whether ``root`` holds a training run (its checkpoints folder marks it)."""
        return self.checkpoints.is_dir()

    # ------------------------------------------------------------------ tracking
    @property
    def mlflow_record(self) -> Path:
        return self.root / MLFLOW_RECORD

    # ------------------------------------------------------------------ later stages
    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def hf_export(self) -> Path:
        """`unmask export --format hf`: the model as a transformers directory."""
        return self.root / "export-hf"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def results(self) -> Path:
        return self.report / "results.json"

    @property
    def data(self) -> Path:
        """The shards of `unmask run`'s prep stage."""
        return self.root / "data"

    @property
    def corpus(self) -> Path:
        """The built-in corpus of `unmask run` without --input."""
        return self.root / "corpus"

    @property
    def summary(self) -> Path:
        return self.root / "run_summary.json"


# Two of these make a run written before the marker (one file name alone could be anyone's).
_RUN_SIGNS = 2
# The file `unmask run` writes into RUN/corpus without --input (data_prep.builtin_corpus).
_BUILTIN_CORPUS = re.compile(r"cpython-[\w.+]+-docs\.jsonl")


def _is_prep(directory: Path) -> bool:
    """Whether ``directory`` holds a prep (marked so, or with a prep's manifest): RUN/data."""
    manifest = json_object(directory / "manifest.json")
    return (read_marker(directory) or {}).get("kind") == "prep" or (
        manifest is not None and "prep_config_sha256" in manifest)


def _run_signs(layout: RunLayout) -> int:
    """How many of the things only a training run holds ``layout.root`` holds: a checkpoint
    with its state, a checkpoints/latest naming one, the resolved config, the tokenizer
    directory, metrics records, the summary of `unmask run`."""
    config, summary = json_object(layout.config), json_object(layout.summary)
    first_record = _first_line(layout.metrics)
    signs = [any(layout.checkpoints.glob("step-*/unmask_state.json")),
             layout.latest.is_file() and TAG_PATTERN.match(_first_line(layout.latest).strip()) is not None,
             config is not None and {"model", "train", "data"} <= config.keys(),
             layout.tokenizer.is_dir(),
             first_record.startswith('{"step": '),
             summary is not None and "stages" in summary]
    return sum(signs)


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.readline()
    except OSError:
        return ""


def _is_unmarked_run(directory: Path) -> bool:
    """A run directory without the marker (of an earlier version, or one where Ray Train wrote
    its records first): nothing but names a run holds, and either two of the things only a run
    holds (``_run_signs``) or nothing but what a run holds before its first step (the corpus
    and data of `unmask run`, Ray Train's records). A user's directory of notes and their own
    metrics.jsonl or config.json is not taken for one."""
    layout = RunLayout(directory)
    names = entry_names(directory)
    if not names or not names <= layout.entry_names():
        return False
    before_first_step = {layout.data.name, layout.corpus.name, layout.ray_train.name}
    if names <= before_first_step:  # each what `unmask run` (or Ray Train) writes there, not a folder of that name
        return ((not layout.data.exists() or _is_prep(layout.data))
                and (not layout.corpus.exists() or holds_only(layout.corpus, _BUILTIN_CORPUS.fullmatch)))
    return _run_signs(layout) >= _RUN_SIGNS


# What `unmask train --run-dir` and `unmask run --run-dir` write: a directory that grows in place.
RUN_KIND = OutputKind("run", "an unmask training run", whole=False, unmarked=_is_unmarked_run)


def training_data(path: str | Path) -> InputPath:
    """The data a run trains on, as an input its run directory keeps clear of: the run may hold
    it (`unmask run`'s RUN/data), but must not be it or lie inside it."""
    return InputPath(path, "--data (data.path)", may_lie_inside=True)

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

from common.outputs import InputPath, OutputKind, entry_names, holds_only, read_marker

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

    def training_writes(self) -> tuple[Path, ...]:
        """What `unmask train` writes in the run directory itself: every path but its checkpoints
        (which may lie elsewhere, through a link: ``pipeline.run_dir.claim``)."""
        return (self.lock, self.config, self.tokenizer, self.metrics, self.mlflow_record)

    def before_first_step(self) -> tuple[Path, ...]:
        """What `unmask train` writes before its first step (nothing worth keeping yet)."""
        return (*self.training_writes(), self.checkpoints)

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

    def pipeline_writes(self) -> tuple[Path, ...]:
        """What `unmask run` writes in the run directory beside its stages' own outputs."""
        return (self.corpus, self.data, self.summary)


# The file `unmask run` writes into RUN/corpus without --input (data_prep.builtin_corpus).
_BUILTIN_CORPUS = re.compile(r"cpython-[\w.+]+-docs\.jsonl")


def _is_prep(directory: Path) -> bool:
    """Whether ``directory`` is marked as a prep's (RUN/data)."""
    return (read_marker(directory) or {}).get("kind") == "prep"


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.readline()
    except OSError:
        return ""


def _is_restored_checkpoint(layout: RunLayout) -> bool:
    """Whether RUN/checkpoints holds what the Ray Train launcher restores from --storage into a
    run directory it finds empty (``orchestration.cluster.ray_train.restore_newer_checkpoint``):
    a checkpoint with its state, and a checkpoints/latest naming one."""
    return (any(layout.checkpoints.glob("step-*/unmask_state.json"))
            and TAG_PATTERN.match(_first_line(layout.latest).strip()) is not None)


def _is_linked_to_nothing(path: Path) -> bool:
    """Whether ``path`` is a link to an empty directory: checkpoints/ made to lie on a bigger
    disk before the run's first training."""
    return path.is_symlink() and path.is_dir() and not any(path.iterdir())


def _is_unmarked_run(directory: Path) -> bool:
    """A run directory that training has not marked yet because another writer came first: the
    corpus and data of `unmask run` (or a prep into RUN/data), Ray Train's records (RUN/ray_train)
    and the checkpoint it restores from --storage; or the user, whose checkpoints/ is a link to
    an empty directory elsewhere. Nothing else, and each only as that writer leaves it: a folder
    of the user's named data/ or corpus/ is not taken for a run."""
    layout = RunLayout(directory)
    names = entry_names(directory)
    written_first = {layout.data.name, layout.corpus.name, layout.ray_train.name, layout.checkpoints.name}
    if not names or not names <= written_first:
        return False
    return ((not layout.data.exists() or _is_prep(layout.data))
            and (not layout.corpus.exists() or holds_only(layout.corpus, _BUILTIN_CORPUS.fullmatch))
            and (not layout.checkpoints.exists() or _is_restored_checkpoint(layout)
                 or _is_linked_to_nothing(layout.checkpoints)))


# What `unmask train --run-dir` and `unmask run --run-dir` write: a directory that grows in place.
RUN_KIND = OutputKind("run", "an unmask training run", whole=False, unmarked=_is_unmarked_run)


def training_data(path: str | Path) -> InputPath:
    """The data a run trains on, as an input its run directory keeps clear of: the run may hold
    it (`unmask run`'s RUN/data), but must not be it or lie inside it."""
    return InputPath(path, "--data (data.path)", may_lie_inside=True)

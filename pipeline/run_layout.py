"""Every file and folder of a run directory, named in one place (README: "Run directory").

A run directory is what ``unmask train`` writes, what ``unmask export`` and ``unmask eval``
add to, and what ``unmask run`` fills stage by stage:

    RUN/config.json               the resolved training config
    RUN/metrics.jsonl             every logged metric (rank 0)
    RUN/train.lock                the lock of the trainer running now
    RUN/tokenizer/                the tokenizer of the data
    RUN/checkpoints/step-N/       checkpoints; RUN/checkpoints/latest names the newest
    RUN/mlflow_run.json           the MLflow run this training logs to (its store is shared:
                                  pipeline.tracking)
    RUN/export/                   model.safetensors, config.json, tokenizer/
    RUN/export-hf/                the same model for transformers (unmask export --format hf)
    RUN/report/                   report.md, report.html, results.json, plots
    RUN/ray_train/                Ray Train's records (--launcher ray without --storage)
    RUN/data/, RUN/corpus/, RUN/run_summary.json   what `unmask run` adds
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunLayout", "step_tag", "TAG_PATTERN"]

TAG_PATTERN = re.compile(r"^step-(\d{8})$")


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

    def is_training_run(self) -> bool:
        """Whether ``root`` holds a training run (its checkpoints folder marks it)."""
        return self.checkpoints.is_dir()

    # ------------------------------------------------------------------ tracking
    @property
    def mlflow_record(self) -> Path:
        return self.root / "mlflow_run.json"

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

"""``unmask run``: prep -> train -> export -> eval (with its report), in one run directory.

Each stage is the ``unmask`` command of the same name, run in this process, and each is
skipped when its output is already up to date, so rerunning a finished run does nothing
and rerunning a failed or killed one continues where it stopped:

- prep: ``RUN/data`` (the prep itself finds a matching manifest and does nothing);
- train: skipped when the latest checkpoint is at ``train.max_steps``; otherwise resumed;
- export: skipped when ``RUN/export`` holds the latest checkpoint;
- eval: skipped when ``RUN/report/results.json`` scored that export on the same datasets.

With no ``--input`` the corpus is the documentation text shipped with CPython
(``data_prep.builtin_corpus``) and the config ``configs/demo.yaml``: a demo that needs no
download and finishes in minutes on a laptop CPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common.errors import UserError, output_dir
from pipeline.checkpoint import TAG_PATTERN, resolve_checkpoint
from pipeline.config import Config, load_config

__all__ = ["RunRequest", "run_pipeline", "DEMO_CONFIG", "SUMMARY_FILE"]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_CONFIG = CONFIGS / "demo.yaml"
DATA_DIR = "data"                  # in the run directory: the shards of `unmask prep`
CORPUS_DIR = "corpus"              # the built-in corpus, written once
REPORT_RESULTS = Path("report") / "results.json"
SUMMARY_FILE = "run_summary.json"
# The built-in corpus is small (about 0.4M tokens): prep's default 0.5% would leave a handful
# of validation sequences, too few for a stable bound.
BUILTIN_VAL_FRACTION = 0.05


@dataclass(frozen=True)
class RunRequest:
    """What ``unmask run`` was asked to do (its flags)."""

    run_dir: Path
    config: str | None = None                   # None: configs/demo.yaml
    overrides: dict[str, str] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()                # empty: the built-in CPython corpus
    read_args: tuple[str, ...] = ()             # --text-format etc., passed to prep
    seq_len: int | None = None                  # None: model.max_seq_len or the preset's
    val_fraction: float | None = None           # None: prep's default (BUILTIN_VAL_FRACTION for the demo)
    tokenizer: str | None = None
    vocab_size: int = 4096
    prep_workers: int = 1
    ray_address: str | None = None
    train_args: tuple[str, ...] = ()            # --launcher ray --num-workers N ...
    datasets: tuple[str, ...] = ("val",)
    data_dir: str | None = None                 # root of the standard eval files
    eval_samples: int = 16
    num_samples: int = 2
    sample_steps: int = 128
    mlflow_uri: str | None = None


def _cli(argv: list[str]) -> None:
    from orchestration.cli import main

    if main(argv) != 0:  # the command printed its error
        raise UserError(f"stage `unmask {argv[0]}` failed (see above); fix it and rerun `unmask run`: "
                        f"finished stages are kept and skipped")


def _latest_step(run_dir: Path) -> int | None:
    try:
        return int(TAG_PATTERN.match(resolve_checkpoint(run_dir).name).group(1))
    except (UserError, AttributeError):
        return None


def _seq_len(request: RunRequest, config: Config) -> int:
    from model.transformer import PRESETS

    if request.seq_len is not None:
        return request.seq_len
    return config.model.max_seq_len or PRESETS[config.model.preset]["max_seq_len"]


def _stage_prep(request: RunRequest, config: Config) -> str:
    data = request.run_dir / DATA_DIR
    inputs, val_fraction = list(request.inputs), request.val_fraction
    if not inputs:
        from data_prep.builtin_corpus import write_cpython_corpus

        inputs = [str(write_cpython_corpus(request.run_dir / CORPUS_DIR))]
        val_fraction = BUILTIN_VAL_FRACTION if val_fraction is None else val_fraction
    split = ["--val-fraction", str(val_fraction)] if val_fraction is not None else []
    tokenizer = ["--tokenizer", request.tokenizer] if request.tokenizer else ["--vocab-size", str(request.vocab_size)]
    cluster = ["--ray-address", request.ray_address] if request.ray_address else []
    manifest = data / "manifest.json"
    before = manifest.stat().st_mtime_ns if manifest.is_file() else None
    _cli(["prep", "--input", *inputs, *request.read_args, "--out", str(data), "--seq-len",
          str(_seq_len(request, config)), *tokenizer, "--workers", str(request.prep_workers),
          "--seed", str(config.train.seed), *split, *cluster])
    if manifest.stat().st_mtime_ns == before:
        return f"skipped: {data} is up to date"
    return f"shards in {data}"


def _override_args(request: RunRequest) -> list[str]:
    return [arg for key, value in request.overrides.items() for arg in (f"--{key}", value)]


def _stage_train(request: RunRequest, config: Config) -> str:
    step = _latest_step(request.run_dir)
    if step is not None and step >= config.train.max_steps:
        return f"skipped: already trained to step {step}"
    mlflow = ["--mlflow-uri", request.mlflow_uri] if request.mlflow_uri else []
    _cli(["train", "--config", str(request.config or DEMO_CONFIG), "--data", str(request.run_dir / DATA_DIR),
          "--run-dir", str(request.run_dir), *mlflow, *request.train_args, *_override_args(request)])
    return f"trained to step {_latest_step(request.run_dir)}"


def _exported_step(run_dir: Path) -> int | None:
    from pipeline.export import CONFIG_FILE, EXPORT_DIR

    path = run_dir / EXPORT_DIR / CONFIG_FILE
    return json.loads(path.read_text()).get("step") if path.is_file() else None


def _stage_export(request: RunRequest, config: Config) -> str:
    step = _latest_step(request.run_dir)
    if _exported_step(request.run_dir) == step:
        return f"skipped: the export holds step {step}"
    _cli(["export", str(request.run_dir)])
    return f"exported step {step} (EMA weights)"


def _evaluated(request: RunRequest) -> bool:
    path = request.run_dir / REPORT_RESULTS
    if not path.is_file():
        return False
    results = json.loads(path.read_text())
    return (results["model"]["step"] == _exported_step(request.run_dir)
            and sorted(results["datasets"]) == sorted(request.datasets)
            and results["protocol"]["samples_per_block"] == request.eval_samples)


def _stage_eval(request: RunRequest, config: Config) -> str:
    if _evaluated(request):
        return f"skipped: {request.run_dir / REPORT_RESULTS} is up to date"
    data_dir = ["--data-dir", request.data_dir] if request.data_dir else []
    _cli(["eval", str(request.run_dir), "--datasets", ",".join(request.datasets), *data_dir,
          "--shards", str(request.run_dir / DATA_DIR), "--samples", str(request.eval_samples),
          "--num-samples", str(request.num_samples), "--sample-steps", str(request.sample_steps)])
    return f"report in {request.run_dir / 'report'}"


STAGES: tuple[tuple[str, Callable[[RunRequest, Config], str]], ...] = (
    ("prep", _stage_prep), ("train", _stage_train), ("export", _stage_export), ("eval", _stage_eval))


def _check_request(request: RunRequest) -> None:
    """The flags that later stages read, before the first stage starts: a bad --datasets or
    --samples must not wait for the end of a training."""
    from evaluation.evaluate import EvalConfig

    checks = [("--prep-workers", request.prep_workers >= 1, "must be >= 1"),
              ("--seq-len", request.seq_len is None or request.seq_len >= 2, "must be >= 2"),
              ("--val-fraction", request.val_fraction is None or 0 <= request.val_fraction < 1,
               "must lie in [0, 1)"),
              ("--num-samples", request.num_samples >= 0, "must be >= 0"),
              ("--sample-steps", request.sample_steps >= 1, "must be >= 1")]
    for flag, ok, requirement in checks:
        if not ok:
            raise UserError(f"{flag} {requirement}")
    EvalConfig(datasets=request.datasets, data_dir=request.data_dir, shards=str(request.run_dir / DATA_DIR),
               samples_per_block=request.eval_samples).check(shards_pending=True)


def run_pipeline(request: RunRequest, *, say: Callable[[str], None] = print) -> dict:
    """Run every stage that is not up to date; the summary (also in ``RUN/run_summary.json``)."""
    config = load_config(request.config or DEMO_CONFIG, request.overrides)  # fail before any work
    _check_request(request)
    output_dir(request.run_dir, "--run-dir")
    start, stages = time.perf_counter(), {}
    for name, stage in STAGES:
        say(f"unmask run: stage {name}")
        stages[name] = stage(request, config)
        say(f"unmask run: stage {name}: {stages[name]}")
    summary = _summary(request, stages, time.perf_counter() - start)
    (request.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(request: RunRequest, stages: dict[str, str], seconds: float) -> dict:
    results = json.loads((request.run_dir / REPORT_RESULTS).read_text())
    return {"run_dir": str(request.run_dir), "seconds": round(seconds, 1), "stages": stages,
            "step": results["model"]["step"], "training": results.get("training"),
            "datasets": {name: {key: record[key] for key in ("nelbo_per_token", "perplexity_bound", "bits_per_byte")}
                         for name, record in results["datasets"].items()},
            "report": str(request.run_dir / "report" / "report.html"), "mlflow": results["mlflow"]}

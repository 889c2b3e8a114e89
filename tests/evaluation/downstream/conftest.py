"""What the lm-eval tests share (``test_run``, ``test_lm_eval_model``): untrained exports of every
process, built once for the folder, and lm-eval without its environment report."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from pipeline.run_dir.layout import RunLayout
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import PTB

MAX_SEQ_LEN = 128   # LAMBADA's contexts are longer with this tokenizer: they are cut


@pytest.fixture
def no_environment_report(monkeypatch):
    """lm-eval records torch's collect_env report in every results file: about 8 s of pip, conda
    and nvidia-smi subprocesses per run, which no test here reads."""
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)


@pytest.fixture(scope="package")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Untrained exports of every process over a tokenizer of PTB's text."""
    root = tmp_path_factory.mktemp("lm-eval-exports")
    lines = PTB.read_text(encoding="utf-8").splitlines()[:2000]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=320)
    configs = {"absorbing": {}, "uniform": {"process": "uniform"},
               "learned": {"process": "learned", "schedule": "learned"}, "ar": {}}
    return {name: write_untrained_export(RunLayout(root / name).export, tokenizer, root / "tok",
                                         objective="autoregressive" if name == "ar" else "diffusion", config=config,
                                         max_seq_len=MAX_SEQ_LEN, time_conditioning=name in ("uniform", "learned"))
            for name, config in configs.items()}

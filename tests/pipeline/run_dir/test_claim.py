"""The run directory claimed around a training (``pipeline.run_dir.claim``): a training that stops
or fails before its first step leaves nothing of the run directory it created (its marker, an
empty lock, the config it resolved). A SIGTERM during start-up is a preemption (exit 75, which
schedulers retry), not a failure (143); a replaced tokenizer is named with what differs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from data_prep.write_shards import PrepConfig, write_shards
from orchestration.exit_codes import PREEMPTED
from tests.support.cli_runner import cli_env, run_unmask
from tests.support.paths import REPO
from tests.support.train_helpers import write_config

WORDS = ["cat", "dog", "fox", "owl", "sat", "ran", "mat", "log"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A finished prep of a small corpus, with its tokenizer kept in data/tokenizer."""
    root = tmp_path_factory.mktemp("prep")
    corpus = root / "c.txt"
    corpus.write_text("\n\n".join(f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)))
    tokenizer = train_sentencepiece([corpus.read_text()], root / "tok", vocab_size=300)
    write_shards(PrepConfig(inputs=(str(corpus),), seq_len=16, val_fraction=0.1), tokenizer, root / "data",
                 progress=False)
    return root / "data"


@pytest.mark.slow
def test_a_sigterm_during_start_up_exits_75_and_leaves_no_run_directory(data, tmp_path):
    run = tmp_path / "new" / "run"
    config = write_config(tmp_path / "micro.yaml")
    command = [sys.executable, "-m", "tests.support.startup_signal", "train", "--config", str(config), "--data", str(data),
               "--run-dir", str(run)]
    stopped = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert stopped.returncode == PREEMPTED, stopped.stderr[-2000:]
    assert "stopped by SIGTERM outside the training loop" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (tmp_path / "new").exists(), sorted(p.name for p in run.rglob("*"))


@pytest.mark.slow
def test_a_replaced_tokenizer_is_named_with_what_differs_and_the_failed_run_leaves_nothing(data, tmp_path):
    replaced = tmp_path / "data"
    shutil.copytree(data, replaced)
    other = train_sentencepiece([f"a {w} b {w}{w} {i}" for i, w in enumerate(WORDS * 40)], tmp_path / "other",
                                vocab_size=290)
    shutil.rmtree(replaced / "tokenizer")
    other.save(replaced / "tokenizer")
    run = tmp_path / "new" / "run"
    failed = run_unmask(["train", "--config", str(write_config(tmp_path / "micro.yaml")), "--data", str(replaced),
                         "--run-dir", str(run)])
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert f"{replaced / 'tokenizer'} holds another tokenizer (sha256 {other.sha256[:12]}..., 290 tokens; the " \
           f"manifest records 300): replaced since the prep" in failed.stderr
    assert "not found" not in failed.stderr
    assert not (tmp_path / "new").exists(), sorted(p.name for p in run.rglob("*"))

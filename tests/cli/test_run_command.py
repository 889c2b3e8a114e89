"""``unmask run`` (``orchestration.commands.run``, ``orchestration.stages``): the checks made before
any work, and a run preempted in training that goes no further.

The whole pipeline runs end to end (submitted through Ray Jobs, then rerun to see every
stage skipped) in tests/cli/cluster/test_jobs.py, and as `make demo` in CI; its built-in
corpus: tests/data_prep/test_builtin_corpus.py.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from orchestration.exit_codes import PREEMPTED
from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import write_a_file
from tests.support.cli_runner import run_unmask, start_unmask
from tests.support.stall import ANNOUNCEMENT
from tests.support.train_helpers import RUN_TIMEOUT_S, write_config


def test_run_checks_its_config_before_doing_anything(tmp_path):
    run_dir = tmp_path / "run"
    missing = run_unmask(["run", "--config", str(tmp_path / "nope.yaml"), "--run-dir", str(run_dir)])
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr
    bad = run_unmask(["run", "--run-dir", str(run_dir), "--train.max_steps", "many"])
    assert bad.returncode == 2 and "train.max_steps" in bad.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_run_preempted_in_training_exits_75_and_goes_no_further(tmp_path):
    """SIGTERM in the train stage: the checkpoint is written, and the run stops there with
    EX_TEMPFAIL instead of exporting a half-trained model and exiting 0."""
    words = random.Random(0).choices(["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away"], k=12_000)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(words[i:i + 12]) for i in range(0, len(words), 12)))
    run_dir = tmp_path / "run"
    args = ["run", "--config", str(write_config(tmp_path / "micro.yaml")), "--input", str(corpus), "--run-dir",
            str(run_dir), "--vocab-size", "300", "--seq-len", "32", "--val-fraction", "0.2"]
    process = start_unmask(args, stall_after=2)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if ANNOUNCEMENT in line:
                process.send_signal(signal.SIGTERM)
        process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(lines)
    assert process.returncode == PREEMPTED, output[-3000:]
    assert "unmask run: stage train was stopped by a signal at step 2 and wrote its checkpoint" in output
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000002"
    assert not (run_dir / "export").exists() and "stage export" not in output


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)


def test_run_checks_its_run_dir_and_eval_flags_before_the_first_stage(capsys, a_file, tmp_path):
    assert f"--run-dir {a_file}: is a file" in _cli(capsys, "run", "--run-dir", str(a_file))
    run = tmp_path / "run"
    err = _cli(capsys, "run", "--run-dir", str(run), "--datasets", "val,nosuchset")
    assert "unknown dataset 'nosuchset'" in err and "stage prep" not in err
    assert "--samples must be >= 1" in _cli(capsys, "run", "--run-dir", str(run), "--samples", "0")
    assert "needs --data-dir" in _cli(capsys, "run", "--run-dir", str(run), "--datasets", "ptb")
    assert not run.exists()

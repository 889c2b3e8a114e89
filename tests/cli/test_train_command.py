"""`unmask train` checks its config, --data and --run-dir before any work, each refused in one
message without a traceback (exit 2), and creates no run directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import installed_cli_error as _unmask
from tests.support.cli_refusals import write_a_file
from tests.support.cli_runner import run_unmask, unmask_in_process


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)


def test_bad_config_fails_on_the_command_line_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  ema_decay: 1.5\n")
    run_dir = tmp_path / "run"
    proc = run_unmask(["train", "--config", str(bad), "--data", str(tmp_path), "--run-dir", str(run_dir)])
    assert proc.returncode == 2
    assert "train.ema_decay = 1.5: must lie in [0, 1)" in proc.stderr
    assert not run_dir.exists()


def test_a_config_that_is_a_directory_is_named_by_train_and_run(tmp_path):
    for argv in (["train", "--config", str(tmp_path), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r")],
                 ["run", "--config", str(tmp_path), "--run-dir", str(tmp_path / "r")]):
        result = _unmask(*argv)
        assert f"{tmp_path}: is a directory, not a YAML config file" in result.stderr
        assert "--config" in result.stderr and not (tmp_path / "r").exists()


def test_train_checks_data_and_run_dir_before_starting(capsys, a_file, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    assert f"--run-dir {a_file}: is a file" in _cli(capsys, "train", "--data", str(data), "--run-dir", str(a_file))
    assert "lies below" in _cli(capsys, "train", "--data", str(data), "--run-dir", str(a_file / "run"))
    run = str(tmp_path / "run")
    assert "(data.path): does not exist" in _cli(capsys, "train", "--data", str(tmp_path / "nope"), "--run-dir", run)
    assert "(data.path): is a file" in _cli(capsys, "train", "--data", str(a_file), "--run-dir", run)
    assert "no manifest.json" in _cli(capsys, "train", "--data", str(tmp_path), "--run-dir", run)
    assert not (tmp_path / "run").exists()


def test_a_global_batch_the_launched_ranks_cannot_share_is_said_once_by_rank_0(capsys, monkeypatch, tmp_path):
    """`torchrun --nproc-per-node 3` with a global batch of 8: each rank advised "a multiple of
    3 or set train.micro_batch_size" (which cannot help); rank 0 now says it once, before any
    work, and the other ranks exit 2 without a word."""
    argv = ["train", "--data", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"),
            "--train.global_batch_size", "8"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in ("1", "2"):
        monkeypatch.setenv("RANK", rank)
        assert unmask_in_process(argv) == 2
        assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert unmask_in_process(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("unmask train: error: config field train.global_batch_size = 8 does not divide over 3 ranks, "
                   "whatever train.micro_batch_size is: make it a multiple of 3 (6 or 9), or run 2 or 4 processes")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_train_refuses_a_read_only_run_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    result = _unmask("train", "--data", str(tmp_path / "data"), "--run-dir", str(locked / "run"))
    assert "--run-dir" in result.stderr and "cannot write there" in result.stderr

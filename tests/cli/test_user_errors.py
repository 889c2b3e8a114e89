"""Mistakes a user can make on the command line end in one clear message (no traceback, exit 2)
before any work is done, and lose nothing already done.

Most cases call ``orchestration.cli.main`` in this process (an escaped exception fails the test just
as a traceback would); a few run the installed ``unmask`` to see what a user sees."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from common.errors import UserError
from pipeline.config import load_config
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.paths import GPT2, needs_shared


def _cli(capsys, *argv: str) -> str:
    """Run ``unmask ARGV`` in this process; it must fail with a UserError: its message."""
    assert unmask_in_process(argv) == 2
    err = capsys.readouterr().err
    assert f"unmask {argv[0]}: error: " in err
    return err


def _unmask(*argv: str) -> subprocess.CompletedProcess:
    """Run the installed ``unmask ARGV``; it must fail with one message, no traceback."""
    result = run_unmask(argv, installed=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return result


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


# ---------------------------------------------------------------- configs
def test_a_config_that_is_a_directory_is_named_by_train_and_run(tmp_path):
    for argv in (["train", "--config", str(tmp_path), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r")],
                 ["run", "--config", str(tmp_path), "--run-dir", str(tmp_path / "r")]):
        result = _unmask(*argv)
        assert f"{tmp_path}: is a directory, not a YAML config file" in result.stderr
        assert "--config" in result.stderr and not (tmp_path / "r").exists()


def test_an_empty_config_warns_that_every_default_applies_and_goes_on(tmp_path, caplog):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set yet\n")
    with caplog.at_level(logging.WARNING, logger="unmask.config"):
        config = load_config(path)
    assert config.train.max_steps == 1_000_000
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(path) in record.getMessage() and "train.max_steps = 1000000" in record.getMessage()


def test_malformed_and_non_utf8_yaml_name_the_line_and_column(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  max_steps: [1\n")
    with pytest.raises(UserError, match=r"broken.yaml line 3, column 1: not valid YAML: expected ',' or ']'.*"
                                        r"flow sequence at line 2, column 14"):
        load_config(broken)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  max_steps: 5 # caf\xe9\n")
    with pytest.raises(UserError, match=r"latin.yaml line 2, column 21: byte 0xe9 is not UTF-8; save the file as UTF-8"):
        load_config(latin)


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` silently dropped the first's fields."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  max_steps: 5\nmodel:\n  preset: tiny\ntrain:\n  seed: 3\n")
    with pytest.raises(UserError, match=r"twice.yaml line 5, column 1: not valid YAML: the key 'train' is given "
                                        r"twice \(first at line 1\)"):
        load_config(twice)
    twice.write_text("optim:\n  lr: 0.1\n  warmup_steps: 5\n  lr: 0.2\n")
    with pytest.raises(UserError, match=r"line 4, column 3: .*the key 'lr' is given twice \(first at line 2\)"):
        load_config(twice)
    with pytest.raises(UserError, match=r"flag --model.schedule_args .*the key 'power' is given twice"):
        load_config(None, {"model.schedule_args": "{power: 2, power: 3}"})


def test_an_override_that_is_not_yaml_names_the_flag():
    with pytest.raises(UserError, match=r"flag --optim.betas '\[0.9': not a valid YAML value"):
        load_config(None, {"optim.betas": "[0.9"})


# ---------------------------------------------------------------- output paths
def test_output_paths_that_are_files_or_below_files_are_refused(a_file):
    from common.outputs import check_output_dir, check_output_file
    from pipeline.interchange.export import EXPORT_KIND

    with pytest.raises(UserError, match=r"--out .*a-file: is a file, not a directory"):
        check_output_dir(a_file, EXPORT_KIND, "--out")
    with pytest.raises(UserError, match=r"--out .*a-file/sub: lies below .*a-file, which is a file"):
        check_output_dir(a_file / "sub", EXPORT_KIND, "--out")
    with pytest.raises(UserError, match=r"--out .*: is a directory; give a file name"):
        check_output_file(a_file.parent, "--out")


def test_an_unwritable_output_directory_is_named(tmp_path, monkeypatch):
    from common.outputs import check_output_dir
    from pipeline.run_dir.layout import RUN_KIND

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(UserError, match=r"--run-dir .*: cannot write there \(Permission denied\); choose a "
                                        r"directory you can write to"):
        check_output_dir(tmp_path / "run", RUN_KIND, "--run-dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_train_refuses_a_read_only_run_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    result = _unmask("train", "--data", str(tmp_path / "data"), "--run-dir", str(locked / "run"))
    assert "--run-dir" in result.stderr and "cannot write there" in result.stderr


@needs_shared(GPT2)
def test_prep_refuses_an_out_that_is_a_file_before_any_work(a_file, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n")
    result = _unmask("prep", "--input", str(corpus), "--out", str(a_file), "--seq-len", "16", "--tokenizer", str(GPT2))
    assert f"--out {a_file}: is a file, not a directory" in result.stderr


def test_prep_and_tokenizer_train_check_out_and_workers_before_training_a_tokenizer(capsys, a_file, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n" * 50)
    assert "is a file" in _cli(capsys, "prep", "--input", str(corpus), "--out", str(a_file), "--seq-len", "16",
                               "--vocab-size", "300")
    assert "is a file" in _cli(capsys, "tokenizer", "train", "--input", str(corpus), "--out", str(a_file),
                               "--vocab-size", "300")
    out = tmp_path / "out"
    assert "--workers must be >= 1" in _cli(capsys, "prep", "--input", str(corpus), "--out", str(out),
                                            "--seq-len", "16", "--vocab-size", "300", "--workers", "0")
    assert not (out / "tokenizer").exists(), "the tokenizer was trained before the flags were checked"


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


def test_run_checks_its_run_dir_and_eval_flags_before_the_first_stage(capsys, a_file, tmp_path):
    assert f"--run-dir {a_file}: is a file" in _cli(capsys, "run", "--run-dir", str(a_file))
    run = tmp_path / "run"
    err = _cli(capsys, "run", "--run-dir", str(run), "--datasets", "val,nosuchset")
    assert "unknown dataset 'nosuchset'" in err and "stage prep" not in err
    assert "--samples must be >= 1" in _cli(capsys, "run", "--run-dir", str(run), "--samples", "0")
    assert "needs --data-dir" in _cli(capsys, "run", "--run-dir", str(run), "--datasets", "ptb")
    assert not run.exists()


def test_export_refuses_a_missing_run_and_never_clears_a_directory_of_other_files(capsys, a_file, tmp_path):
    assert "does not exist, not a training run directory" in _cli(capsys, "export", str(tmp_path / "nope"))
    assert "is a file, not a training run directory" in _cli(capsys, "export", str(a_file))
    run = tmp_path / "run"
    run.mkdir()
    assert f"--out {a_file}: is a file" in _cli(capsys, "export", str(run), "--out", str(a_file))
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert "is not an unmask export: it holds notes.txt" in _cli(capsys, "export", str(run), "--out", str(keep))
    assert (keep / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- eval and sample
def test_eval_checks_every_dataset_before_scoring_any(capsys, tmp_path):
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    # The run does not exist: the datasets are refused before it is even looked at.
    err = _cli(capsys, "eval", str(tmp_path / "run"), "--datasets", f"{own},nosuchset,lm1b,val",
               "--data-dir", str(tmp_path), "--split", "valid")
    assert "unknown dataset 'nosuchset'" in err and "lm1b has no split 'valid'" in err
    assert "dataset 'val' needs --shards" in err and err.count("; and ") == 2  # the own file is fine
    err = _cli(capsys, "eval", str(tmp_path / "run"), "--datasets", "ptb", "--data-dir", str(tmp_path))
    assert "ptb/ptb.test.txt does not exist" in err


def test_eval_checks_out_compare_device_and_samples_before_any_work(capsys, a_file, tmp_path):
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    base = ["eval", str(tmp_path / "run"), "--datasets", str(own)]
    assert f"--out {a_file}: is a file" in _cli(capsys, *base, "--out", str(a_file))
    assert "--compare" in _cli(capsys, *base, "--compare", str(tmp_path / "missing.json"))
    other = tmp_path / "results.json"
    other.write_text(json.dumps({"model": {}, "datasets": {"ptb": {}}}))
    assert "none of --datasets" in _cli(capsys, *base, "--compare", str(other))
    assert "is not a torch device" in _cli(capsys, *base, "--device", "bogus")
    assert "--num-samples must be >= 0" in _cli(capsys, *base, "--num-samples", "-1")


def test_sample_checks_out_before_sampling(capsys, a_file, tmp_path):
    base = ["sample", str(tmp_path / "run"), "--num", "1", "--steps", "2"]
    assert "is a directory; give a file name" in _cli(capsys, *base, "--out", str(tmp_path))
    assert "cannot write this file" in _cli(capsys, *base, "--out", str(a_file / "s.jsonl"))
    # Not into the export (the next `unmask export` would refuse to replace it).
    export = tmp_path / "export"
    err = _cli(capsys, "sample", str(export), "--num", "1", "--out", str(export / "samples.jsonl"))
    assert f"--out {export / 'samples.jsonl'}: lies inside the export it samples ({export}), which the command " \
           f"reads; choose a --out outside it" in err
    assert not export.exists()

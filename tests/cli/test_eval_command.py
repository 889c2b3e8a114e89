"""`unmask eval` checks its flags before any work: every dataset, --out, --compare, --device and
--num-samples, and a sampler sweep of an autoregressive export, each refused in one line; an
evaluation whose samples fail still writes the report of its bounds."""

from __future__ import annotations

import json
import os

import pytest

from evaluation.bounds.scoring import ScoringConfig
from evaluation.zero_shot import ReportOptions, run_zero_shot
from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import one_line_error as _error
from tests.support.cli_runner import DISTRIBUTED_ENV

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def test_credentials_in_the_shards_uri_are_refused_naming_shards(capsys, tmp_path):
    """The refusal named --data, a flag eval does not have; the secret is not echoed."""
    err = _error(capsys, "eval", str(tmp_path / "run"), "--datasets", "val", "--shards", "s3://AKIAX:hunter2@b/shards")
    assert "--shards: the URI carries credentials" in err and "--data:" not in err and "hunter2" not in err


def test_eval_takes_datasets_or_a_suite_and_refuses_both_or_neither_in_one_line(capsys, tmp_path):
    run = str(tmp_path / "run")
    assert "give --datasets NAMES, or --suite zero-shot" in _error(capsys, "eval", run)
    assert "--suite zero-shot chooses its own datasets: give --datasets or --suite, not both" in _error(
        capsys, "eval", run, "--suite", "zero-shot", "--datasets", "ptb", "--data-dir", str(tmp_path))
    err = _error(capsys, "eval", run, "--suite", "zero-shot", "--data-dir", str(tmp_path))
    assert f"--suite zero-shot: none of its sets is under --data-dir {tmp_path}: ptb (test split)" in err
    assert "arxiv (test split): expected arxiv/test.txt" in err


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


def test_eval_of_an_autoregressive_export_with_a_sweep_is_refused_before_scoring(exports, capsys, tmp_path,
                                                                                 text_file):
    out = tmp_path / "report"
    err = _error(capsys, "eval", str(exports["ar"]), "--datasets", str(text_file), "--samples", "2", "--out", str(out),
                 "--num-samples", "1", "--sample-sweep")
    assert "--sample-sweep compares the samplers of a diffusion export" in err and not out.exists()


def test_an_evaluation_whose_samples_fail_still_writes_the_report_of_its_bounds(exports, tmp_path, text_file,
                                                                                monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr("evaluation.zero_shot.generate", out_of_memory)
    out = tmp_path / "report"
    config = ScoringConfig(datasets=(str(text_file),), samples_per_block=2)
    launcher = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        run_zero_shot(exports["diffusion"], config, ReportOptions(num_samples=1, out=out), device="cpu")
    assert {name: os.environ.get(name) for name in DISTRIBUTED_ENV} == launcher, "the failed evaluation left its " \
        "rendezvous variables behind"
    results = json.loads((out / "results.json").read_text())
    assert results["datasets"][str(text_file)]["perplexity_bound"] > 1 and not results.get("samples")
    assert (out / "report.md").is_file()

"""The sampling flags of `unmask sample`, `eval` and `run` (``orchestration.commands.sampling_flags``),
checked before any work: absurd budgets against their named limits, samplers that do not apply
to the config's process, and flags an export or a command would ignore, each refused in one line
naming the flag. Each case runs the real command in this process on untrained tiny exports."""

from __future__ import annotations

import pytest

from tests.support.cli_refusals import MAX_SEQ_LEN
from tests.support.cli_refusals import one_line_error as _error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ABSURD = str(10 ** 12)
# model.sampling.MAX_STEPS_PER_POSITION; the limits are imported where they are tested, so that each
# test here fails alone on a checkout without them.
STEPS_PER_POSITION = 1024


@pytest.mark.parametrize("sampler", ["ancestral", "confidence", "remdm"])
def test_sample_refuses_absurd_budgets_and_lengths_naming_the_flag(exports, capsys, sampler):
    export = str(exports["diffusion"])
    err = _error(capsys, "sample", export, "--num", "1", "--sampler", sampler, "--steps", ABSURD)
    assert "--steps: steps 1,000,000,000,000 is more than MAX_STEPS" in err
    err = _error(capsys, "sample", export, "--num", "1", "--sampler", sampler, "--steps", "100000", "--seq-len", "16")
    assert "--steps: steps 100,000 is more than MAX_STEPS_PER_POSITION = 1,024 per position" in err
    err = _error(capsys, "sample", export, "--num", "1", "--sampler", sampler, "--seq-len", "100000000",
                 "--block-len", "64")
    assert "--seq-len: a sample of 100,000,000 tokens is longer than MAX_SAMPLE_LEN" in err


def test_eval_refuses_an_absurd_sample_budget_before_scoring(exports, capsys, tmp_path, text_file):
    out = tmp_path / "report"
    base = ["eval", str(exports["diffusion"]), "--datasets", str(text_file), "--samples", "2", "--out", str(out),
            "--num-samples", "1"]
    assert "--sample-steps: steps 1,000,000,000,000 is more than MAX_STEPS" in _error(capsys, *base, "--sample-steps",
                                                                                       ABSURD)
    err = _error(capsys, *base, "--sample-steps", str(STEPS_PER_POSITION * MAX_SEQ_LEN + 1))
    assert "--sample-steps: steps 65,537 is more than MAX_STEPS_PER_POSITION" in err
    assert not out.exists(), "the bound was scored before the plan was checked"


def test_run_checks_the_report_s_sampler_against_the_config_s_process_before_prep(capsys, tmp_path):
    run = tmp_path / "run"
    err = _error(capsys, "run", "--run-dir", str(run), "--num-samples", "1", "--sampler", "remdm",
                 "--model.process", "uniform", "--model.time_conditioning", "true")
    assert "--sampler remdm: the remdm sampler does not apply to the uniform process" in err
    err = _error(capsys, "run", "--run-dir", str(run), "--sample-steps", ABSURD)
    assert "--sample-steps: steps 1,000,000,000,000 is more than MAX_STEPS" in err
    err = _error(capsys, "run", "--run-dir", str(run), "--sample-steps", "64", "--model.objective", "autoregressive")
    assert "--sample-steps: the config" in err and "autoregressive model" in err
    err = _error(capsys, "run", "--run-dir", str(run), "--num-samples", "0", "--sampler", "remdm")
    assert "--sampler says how the report's samples are drawn, and there are none" in err
    assert not run.exists(), "a stage ran before the flags were checked"


def test_sampling_flags_an_export_or_a_command_would_ignore_are_refused(exports, capsys, tmp_path, text_file):
    ar = str(exports["ar"])
    err = _error(capsys, "sample", ar, "--num", "1", "--steps", "64")
    assert "--steps: " in err and "is an autoregressive model" in err and "leave --steps out" in err
    assert "leave --grid out" in _error(capsys, "sample", ar, "--num", "1", "--grid", "cosine")
    assert "--sampler-option: sampler option eta is given twice" in _error(
        capsys, "sample", str(exports["diffusion"]), "--num", "1", "--sampler", "remdm",
        "--sampler-option", "eta=0.01", "--sampler-option", "eta=0.02")
    assert "--grid: the first-hitting sampler has no time grid" in _error(
        capsys, "sample", str(exports["diffusion"]), "--num", "1", "--sampler", "first-hitting", "--grid", "cosine")
    base = ["eval", ar, "--datasets", str(text_file), "--out", str(tmp_path / "report")]
    assert "--sample-steps: " in _error(capsys, *base, "--num-samples", "1", "--sample-steps", "64")
    err = _error(capsys, *base, "--sampler", "remdm", "--sample-temperature", "0.8")
    assert err.endswith("--sampler says how the report's samples are drawn, and there are none: give --num-samples N "
                        "too (or leave --sampler, --sample-temperature out)")
    assert not (tmp_path / "report").exists()

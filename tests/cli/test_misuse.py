"""Misuse that used to cost work, run on without a bound or pass without a word:
absurd sampling budgets against their named limits, checks that wait for no stage, flags that
would change nothing, and lm-eval's task YAMLs read before lm-eval runs their code.

Each case runs the real command (``orchestration.cli.main`` in this process) on real exports of
untrained tiny networks; every refusal is one line naming the flag, file or field."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.bounds.scoring import ScoringConfig
from evaluation.zero_shot import ReportOptions, run_zero_shot
from model.absorbing import AbsorbingDiffusion
from model.sampling import PlanError, RemaskOptions, SamplingPlan, parse_sampler_options
from model.schedules import make_schedule
from pipeline.config import load_config, parse_overrides
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_runner import DISTRIBUTED_ENV, unmask_in_process
from tests.support.export_fixtures import write_untrained_export

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_SEQ_LEN = 64
ABSURD = str(10 ** 12)
# model.sampling.MAX_STEPS_PER_POSITION; the limits are imported where they are tested, so that each
# test here fails alone on a checkout without them.
STEPS_PER_POSITION = 1024


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("misuse")
    lines = [f"the cat {i} sat on the mat {i * 7 % 13} and said hello {i % 5}" for i in range(400)]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=300)
    return {name: write_untrained_export(RunLayout(root / name).export, tokenizer, root / "tok", objective=objective,
                                         max_seq_len=MAX_SEQ_LEN)
            for name, objective in (("diffusion", "diffusion"), ("ar", "autoregressive"))}


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "own.txt"
    path.write_text("the cat sat on the mat and said hello\n\nthe dog sat on the log\n")
    return path


def _error(capsys, *argv: str) -> str:
    """``unmask ARGV`` must fail with one line (exit 2): that line."""
    assert unmask_in_process(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"unmask {argv[0]}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- budgets: named limits, before any work
@pytest.mark.parametrize("sampler", ["ancestral", "confidence", "remdm"])
def test_an_absurd_budget_is_refused_when_the_plan_is_made(sampler):
    from model.sampling import MAX_STEPS

    with pytest.raises(PlanError, match=f"steps 1,000,000,000,000 is more than MAX_STEPS = {MAX_STEPS:,}") as caught:
        SamplingPlan(sampler=sampler, steps=10 ** 12)
    assert caught.value.field == "steps"
    assert SamplingPlan(sampler=sampler, steps=MAX_STEPS).steps == MAX_STEPS


def test_steps_per_position_and_sample_length_have_limits_checked_before_the_grid_is_built():
    from model.sampling import MAX_SAMPLE_LEN, MAX_STEPS_PER_POSITION, check_budget

    plan = SamplingPlan(steps=100_000)
    with pytest.raises(PlanError, match=r"more than MAX_STEPS_PER_POSITION = 1,024 per position of a sequence of 16 "
                                        r"\(at most 16,384\)"):
        check_budget(plan, 16)
    check_budget(plan, 128)                       # 131,072 allowed
    with pytest.raises(PlanError, match="per position of a block of 64"):
        check_budget(SamplingPlan(steps=100_000, block_len=64), 4096)
    check_budget(SamplingPlan(sampler="first-hitting", steps=100_000), 16)   # no grid: one call per token at most
    with pytest.raises(PlanError, match=f"longer than MAX_SAMPLE_LEN = {MAX_SAMPLE_LEN:,}") as caught:
        check_budget(SamplingPlan(block_len=64), 100_000_000)
    assert caught.value.field == "seq_len"
    # The samplers' own entry refuses it before building a grid of the steps.
    process = AbsorbingDiffusion(make_schedule("linear"), 5)
    with pytest.raises(PlanError, match="MAX_STEPS_PER_POSITION"):
        process.sample(lambda z, t: torch.zeros(*z.shape, 5), SamplingPlan(steps=MAX_STEPS_PER_POSITION * 16 + 1),
                       num_samples=1, seq_len=16)


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


# ---------------------------------------------------------------- checks that wait for no stage
def test_eval_of_an_autoregressive_export_with_a_sweep_is_refused_before_scoring(exports, capsys, tmp_path,
                                                                                 text_file):
    out = tmp_path / "report"
    err = _error(capsys, "eval", str(exports["ar"]), "--datasets", str(text_file), "--samples", "2", "--out", str(out),
                 "--num-samples", "1", "--sample-sweep")
    assert "--sample-sweep compares the samplers of a diffusion export" in err and not out.exists()


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


def test_a_hugging_face_reference_whose_own_code_must_run_is_refused_before_sampling(capsys, tmp_path, text_file):
    reference = tmp_path / "custom-lm"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {
        "AutoModelForCausalLM": "modeling_custom.CustomLM"}}))
    (reference / "model.safetensors").write_bytes(b"")
    (reference / "modeling_custom.py").write_text("raise SystemExit('this code ran')\n")
    # The export does not exist: the reference is checked first, so no sample is ever drawn.
    for argv in (["sample", str(tmp_path / "no-export"), "--num", "1"],
                 ["eval", str(tmp_path / "no-export"), "--datasets", str(text_file), "--num-samples", "1"]):
        err = _error(capsys, *argv, "--reference", str(reference))
        assert f"--reference {reference}: model_type 'my_custom_lm' is not a causal LM of transformers" in err
        assert "maps it to the directory's own code (auto_map), which unmask never runs" in err


# ---------------------------------------------------------------- flags that would change nothing
def test_sampler_options_given_twice_or_of_another_schedule_are_refused():
    with pytest.raises(PlanError, match=r"sampler option eta is given twice \(0.01, then 0.02\)") as caught:
        parse_sampler_options("remdm", ["eta=0.01", "eta=0.02"])
    assert caught.value.field == "options.eta"
    with pytest.raises(PlanError, match="sampler option t_on is the loop schedule's: the cap schedule does not read"):
        parse_sampler_options("remdm", ["t_on=0.6"])
    with pytest.raises(PlanError, match="the rescale schedule does not read it"):
        parse_sampler_options("remdm", ["schedule=rescale", "alpha_on=0.8"])
    assert parse_sampler_options("remdm", ["schedule=loop", "t_on=0.6"]) == RemaskOptions(schedule="loop", t_on=0.6)
    with pytest.raises(PlanError, match="the first-hitting sampler has no time grid") as caught:
        SamplingPlan(sampler="first-hitting", grid="cosine")
    assert caught.value.field == "grid"


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


def test_a_config_override_given_twice_is_refused_as_a_yaml_key_given_twice():
    with pytest.raises(UserError, match=r"config override --train.max_steps is given twice \('5', then '7'\)"):
        parse_overrides(["--train.max_steps", "5", "--train.max_steps=7"])


def test_an_infinite_or_nan_config_number_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  grad_clip: .inf\n")
    with pytest.raises(UserError, match=r"field optim.grad_clip = inf: expected a finite number"):
        load_config(path)
    with pytest.raises(UserError, match=r"flag --optim.lr = nan: expected a finite number"):
        load_config(None, {"optim.lr": ".nan"})


# ---------------------------------------------------------------- lm-eval: the user's task YAMLs
BROKEN_TASK = "task: broken\ndataset_path: json\noutput_type: [loglikelihood\ntest_split: test\n"
CODE_TASK = """\
task: code_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
process_docs: !function helpers.process
doc_to_text: "{{{{text}}}}"
doc_to_target: " x"
"""


@pytest.fixture
def task_dirs(tmp_path) -> dict[str, Path]:
    data = tmp_path / "doc.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    dirs = {name: tmp_path / name for name in ("broken", "code", "missing")}
    for path in dirs.values():
        path.mkdir()
    (dirs["broken"] / "broken.yaml").write_text(BROKEN_TASK)
    (dirs["code"] / "code_task.yaml").write_text(CODE_TASK.format(data=data))
    (dirs["code"] / "helpers.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n"
                                             "def process(docs):\n    return docs\n")
    (dirs["missing"] / "missing.yaml").write_text(CODE_TASK.format(data=tmp_path / "nope.jsonl")
                                                  .replace("process_docs: !function helpers.process\n", ""))
    return dirs


def test_lm_eval_names_a_broken_task_yaml_s_line_and_column(exports, capsys, task_dirs, tmp_path):
    export, out = str(exports["ar"]), str(tmp_path / "report")
    where = (f"task YAML {task_dirs['broken'] / 'broken.yaml'} line 4, column 11: not valid YAML: expected ',' or "
             f"']', but got ':' (while parsing a flow sequence at line 3, column 14)")
    err = _error(capsys, "lm-eval", export, "--tasks", "broken", "--include-path", str(task_dirs["broken"]),
                 "--out", out)
    assert where in err and "unknown task" not in err
    err = _error(capsys, "lm-eval", export, "--tasks", str(task_dirs["broken"] / "broken.yaml"), "--out", out)
    assert where in err and "--download" not in err
    err = _error(capsys, "lm-eval", export, "--tasks", "missing_files", "--include-path", str(task_dirs["missing"]),
                 "--out", out)
    assert f"missing.yaml line 5, column 11: data_files '{tmp_path / 'nope.jsonl'}'" in err
    assert "matches no file" in err and "rerun with --download" not in err


def test_lm_eval_refuses_a_task_yaml_that_names_code_unless_allowed(exports, capsys, task_dirs, tmp_path):
    from evaluation.downstream.task_yamls import check_task_yamls

    err = _error(capsys, "lm-eval", str(exports["ar"]), "--tasks", "code_task", "--include-path",
                 str(task_dirs["code"]), "--out", str(tmp_path / "report"))
    assert (f"code_task.yaml line 8, column 15: '!function helpers.process' makes lm-eval import and run Python from "
            f"{task_dirs['code']}; rerun with --allow-code") in err
    assert not (tmp_path / "RAN").exists()
    check_task_yamls([str(task_dirs["code"])], [], allow_code=True)   # allowed: read, and nothing run here
    assert not (tmp_path / "RAN").exists()


def test_lm_eval_download_without_a_network_fails_at_once_in_one_line(exports, capsys, tmp_path, monkeypatch):
    with socket.socket() as unused:            # a loopback port nobody listens on: no network
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)   # the probe goes to the endpoint itself
    err = _error(capsys, "lm-eval", str(exports["ar"]), "--tasks", "lambada_openai", "--download",
                 "--out", str(tmp_path / "report"))
    assert f"--download: the Hugging Face Hub at http://127.0.0.1:{port} cannot be reached" in err
    assert "leave --download out" in err


@pytest.mark.parametrize("limit", ["abc", "1.5", "0", "nan"])
def test_lm_eval_limit_must_be_documents_or_a_fraction(exports, capsys, limit):
    """lm-eval would cut 1.5 to 1 document without a word: refused, as a word or a non-positive number."""
    with pytest.raises(SystemExit) as exited:   # argparse's usage error
        unmask_in_process(["lm-eval", str(exports["ar"]), "--tasks", "ptb_word_order", "--limit", limit])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and err == (f"unmask lm-eval: error: argument --limit: '{limit}' is neither a whole "
                                              f"number of documents (>= 1) nor a fraction of them in (0, 1)")


def test_a_recorded_first_hitting_plan_with_a_grid_is_refused_naming_the_field():
    """First-hitting has no time grid: a record that names one is not a plan, and says so."""
    record = {**SamplingPlan(sampler="first-hitting").to_dict(), "grid": "cosine"}
    with pytest.raises(PlanError, match="the first-hitting sampler has no time grid") as caught:
        SamplingPlan.from_dict(record)
    assert caught.value.field == "grid"


def test_the_lm_eval_library_refuses_a_limit_lm_eval_would_cut():
    from evaluation.downstream.run import DownstreamConfig

    for limit in (1.5, 0, -2):
        with pytest.raises(UserError, match=r"--limit must be a whole number of documents N >= 1, or a fraction"):
            DownstreamConfig(tasks=("ptb_word_order",), limit=limit).check()
    for limit in (0.25, 3, 3.0):
        DownstreamConfig(tasks=("ptb_word_order",), limit=limit).check()


def test_the_hub_probe_goes_through_the_proxy_the_environment_names(monkeypatch):
    """Behind a proxy the Hub's host is not reached directly: the probe must not refuse --download there."""
    from evaluation.downstream.run import check_hub_reachable

    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        check_hub_reachable(timeout=5)
        monkeypatch.delenv("https_proxy")
        with pytest.raises(UserError, match="--download: the Hugging Face Hub at https://hub.invalid cannot be reached"):
            check_hub_reachable(timeout=5)

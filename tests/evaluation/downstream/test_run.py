"""``unmask lm-eval`` (``evaluation.downstream.run``), through the real harness.

A micro diffusion run, trained and tracked on a real MLflow server, scores the local LAMBADA and
the PTB word-order choice into its report and its MLflow run; an AR export scores them too and
its numbers are checked against a plain forward pass of the causal network, written here; bad
input gets one line. The harness's ``unmask`` model request by request: test_lm_eval_model.
Nothing downloads (the harness runs offline).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from evaluation.downstream.lm_eval_model import main as lm_eval_main
from evaluation.downstream.run import hub_offline
from evaluation.downstream.tasks import TASKS_DIR
from evaluation.downstream.tasks.local_data import ptb_word_order
from pipeline.interchange.export import load_export
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_runner import unmask_in_process
from tests.support.paths import PTB, SHARED, needs_shared
from tests.support.train_helpers import run_train, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread", "no_environment_report"),
              needs_shared("lambada/lambada_test.jsonl", "ptb/ptb.test.txt")]

LIMIT = "6"
LAMBADA = SHARED / "lambada" / "lambada_test.jsonl"
# One document of several blocks (the rolling agreement with `unmask eval`).
ROLLING_TASK = """\
task: one_document
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""

HUB_ONLY_TASK = """\
task: hub_only
dataset_path: unmask-tests/no-such-dataset
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: " x"
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinyshakespeare_shards, mlflow_server) -> Path:
    """A micro diffusion run (no export yet), tracked on a real MLflow server."""
    root = tmp_path_factory.mktemp("lm-eval-run")
    config = write_config(root / "c.yaml", {"train": {"max_steps": 4}, "eval": {"every": 0}})
    return run_train(root / "run", tinyshakespeare_shards, config, extra=["--mlflow-uri", mlflow_server]).run_dir


def _lm_eval(*argv: str) -> None:
    assert unmask_in_process(["lm-eval", *argv]) == 0


def _first_documents(count: int) -> list[str]:
    return [json.loads(line)["text"] for line in LAMBADA.read_text(encoding="utf-8").splitlines()[:count]]


def _exact_log_likelihood(exported, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) of a causal export by one plain forward pass (context cut
    from the left to fit), encoded as lm-eval encodes a pair, and whether it is the greedy one."""
    tokenizer, network = exported.tokenizer, exported.network
    context_ids = tokenizer.encode(context)
    continuation_ids = tokenizer.encode(context + continuation)[len(context_ids):]
    tokens = (context_ids + continuation_ids)[-network.config.max_seq_len:]
    inputs = torch.tensor([[network.config.vocab_size, *tokens[:-1]]])
    with torch.no_grad():
        logp = torch.log_softmax(network(inputs, None)[0].double(), -1)
    scored = range(len(tokens) - len(continuation_ids), len(tokens))
    return (sum(float(logp[i, tokens[i]]) for i in scored), all(int(logp[i].argmax()) == tokens[i] for i in scored))


# ---------------------------------------------------------------- the command
def test_lm_eval_puts_lambada_and_a_choice_task_beside_the_bounds_in_the_report_and_the_run(
        trained, mlflow_server):
    run = trained
    assert unmask_in_process(["eval", str(run), "--datasets", "ptb", "--data-dir", str(SHARED),
                              "--max-documents", "4", "--samples", "2"]) == 0
    _lm_eval(str(run), "--tasks", "lambada_openai_local,ptb_word_order", "--data-dir", str(SHARED),
             "--limit", LIMIT, "--samples", "2")
    report = RunLayout(run).report
    results = json.loads((report / "lm_eval_results.json").read_text())          # lm-eval's own file
    lambada, choice = results["results"]["lambada_openai_local"], results["results"]["ptb_word_order"]
    assert 0 <= lambada["acc,none"] <= 1 and 0 <= choice["acc,none"] <= 1
    assert results["n-samples"]["ptb_word_order"]["effective"] == int(LIMIT)
    record = json.loads((report / "downstream.json").read_text())["tasks"]["lambada_openai_local"]
    assert record["requests"] == int(LIMIT) and record["monte_carlo_error"] > 0
    # lm-eval's perplexity is exp(-mean) of the bounds this model gave it: an upper bound.
    assert lambada["perplexity,none"] == pytest.approx(math.exp(-record["mean_log_likelihood"]), rel=1e-9)
    training_run = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    metrics = MlflowClient(mlflow_server).get_run(training_run).data.metrics
    assert metrics["lm_eval/lambada_openai_local/acc"] == lambada["acc,none"]
    assert metrics["lm_eval/ptb_word_order/acc_norm"] == choice["acc_norm,none"]
    assert "eval/ptb/perplexity_bound" in metrics          # the bounds are in the same run
    # A later `unmask eval` rewrites the report whole and keeps the downstream section and records.
    kept = {name: (report / name).read_bytes() for name in ("lm_eval_results.json", "downstream.json")}
    assert unmask_in_process(["eval", str(run), "--datasets", "ptb", "--data-dir", str(SHARED),
                              "--max-documents", "4", "--samples", "2"]) == 0
    assert {name: (report / name).read_bytes() for name in kept} == kept
    for name in ("report.md", "report.html"):
        text = (report / name).read_text()
        assert "Downstream tasks" in text and "lambada_openai_local" in text and "Results" in text


def test_the_autoregressive_baseline_s_lambada_and_choices_are_exact(exports, tmp_path):
    _lm_eval(str(exports["ar"]), "--tasks", "lambada_openai_local,ptb_word_order", "--data-dir", str(SHARED),
             "--limit", LIMIT, "--out", str(tmp_path))
    results = json.loads((tmp_path / "lm_eval_results.json").read_text())["results"]
    exported = load_export(exports["ar"])
    # lambada_openai's split: the passage but its last word, then " " + that word.
    scores = [_exact_log_likelihood(exported, context, " " + word)
              for context, word in (text.rsplit(" ", 1) for text in _first_documents(int(LIMIT)))]
    lambada = results["lambada_openai_local"]
    assert lambada["perplexity,none"] == pytest.approx(math.exp(-sum(s for s, _ in scores) / len(scores)), rel=1e-5)
    assert lambada["acc,none"] == pytest.approx(sum(g for _, g in scores) / len(scores))
    documents = list(ptb_word_order(data_dir=str(SHARED))["test"])[:int(LIMIT)]
    right = [max(range(2), key=lambda i: _exact_log_likelihood(exported, d["context"], " " + d["choices"][i])[0])
             == d["label"] for d in documents]
    assert results["ptb_word_order"]["acc,none"] == pytest.approx(sum(right) / len(right))
    record = json.loads((tmp_path / "downstream.json").read_text())["tasks"]["lambada_openai_local"]
    assert record["truncated_contexts"] > 0 and record["monte_carlo_error"] == 0


def test_a_one_document_perplexity_task_gives_unmask_eval_s_bits_per_byte(exports, tmp_path):
    text = " ".join(PTB.read_text(encoding="utf-8").splitlines()[:12])    # several blocks of 64 tokens
    document = tmp_path / "doc.jsonl"
    document.write_text(json.dumps({"text": text}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "one_document.yaml").write_text(ROLLING_TASK.format(path=document))
    _lm_eval(str(exports["absorbing"]), "--tasks", "one_document", "--include-path", str(tasks), "--samples", "4",
             "--seed", "3", "--out", str(tmp_path / "lm"))
    assert unmask_in_process(["eval", str(exports["absorbing"]), "--datasets", str(document), "--samples", "4",
                              "--seed", "3", "--out", str(tmp_path / "eval")]) == 0
    ours = json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"][str(document)]
    theirs = json.loads((tmp_path / "lm" / "lm_eval_results.json").read_text())["results"]["one_document"]
    assert ours["estimate"]["num_blocks"] > 1
    assert theirs["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-9)


def test_the_hugging_face_libraries_are_offline_inside_and_as_they_were_after(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_DATASETS_OFFLINE"] == "0"
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before


# ---------------------------------------------------------------- bad input: one line each
def _error(capsys, *argv: str) -> str:
    assert unmask_in_process(["lm-eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unmask lm-eval: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_input_gets_one_clear_line(exports, capsys, tmp_path):
    export = str(exports["ar"])
    assert "unknown task 'lambada_opnai' (did you mean lambada_openai" in _error(
        capsys, export, "--tasks", "lambada_opnai", "--data-dir", str(SHARED))
    empty = tmp_path / "data"
    empty.mkdir()
    missing = _error(capsys, export, "--tasks", "lambada_openai_local", "--data-dir", str(empty))
    assert f"expected file {empty / 'lambada' / 'lambada_test.jsonl'} does not exist" in missing
    assert "--data-dir DIR" in _error(capsys, export, "--tasks", "ptb_word_order")
    tasks = tmp_path / "tasks"   # a task whose dataset is on the Hub only: offline, it fails at once
    tasks.mkdir()
    (tasks / "hub_only.yaml").write_text(HUB_ONLY_TASK)
    offline = _error(capsys, export, "--tasks", "hub_only", "--include-path", str(tasks))
    assert offline.startswith("unmask lm-eval: error: --tasks hub_only: lm-eval could not load the task")
    assert offline.endswith("rerun with --download to let lm-eval fetch it from the Hugging Face Hub)")
    assert unmask_in_process(["lm-eval", export, "--tasks", "ptb_word_order", "--samples", "0"]) == 2
    code = lm_eval_main(["--model", "unmask", "--model_args", f"path={export},samplse=4", "--tasks", "ptb_word_order",
                         "--include_path", str(TASKS_DIR), "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("lm-eval (unmask): error: model argument 'samplse'")
    assert err.endswith("(did you mean samples?)")

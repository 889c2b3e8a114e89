"""The record of ``unmask lm-eval`` (``downstream.json``), its report section and its MLflow names."""

import copy
import json

import pytest

from evaluation.report.results_tracking import downstream_metrics
from evaluation.report.write import JSON_NAME, write_report
from evaluation.results import DownstreamResults
from tests.evaluation.report.test_write import make_results

LAMBADA = {"acc,none": 0.3125, "acc_stderr,none": 0.0064, "perplexity,none": 41.5, "perplexity_stderr,none": 1.2}
GSM = {"exact_match,strict-match": 0.02, "exact_match_stderr,strict-match": 0.004,
       "bits_per_byte,none": 1.1, "bits_per_byte_stderr,none": "N/A"}


def make_downstream(objective: str = "diffusion", step: int = 12000) -> dict:
    results = make_results(objective)
    model = {**results["model"], "step": step}
    return {
        "model": model,
        "tasks": {
            "lambada_openai": {"metrics": LAMBADA, "higher_is_better": {"acc": True, "perplexity": False},
                               "documents": 500, "documents_total": 5153, "requests": 500,
                               "mean_log_likelihood": -3.7257, "monte_carlo_error": 0.0421,
                               "median_request_error": 1.93, "truncated_contexts": 3},
            "gsm8k": {"metrics": GSM, "higher_is_better": {"exact_match": True}, "documents": 10,
                      "documents_total": 10, "requests": 0, "mean_log_likelihood": None, "monte_carlo_error": None,
                      "median_request_error": None, "truncated_contexts": 0}},
        "settings": {"tasks": ["lambada_openai", "gsm8k"], "samples": 16, "seed": 0, "limit": 500,
                     "num_fewshot": None},
        "lm_eval_version": "0.4.13", "lm_eval_results": "lm_eval_results.json",
        "mlflow": {"tracking_uri": "http://127.0.0.1:5000", "run_id": "0123abcd"},
        "created": "2025-01-02T03:04:05+00:00", "unmask_version": "0.1.0", "git_commit": "deadbeef"}


def _row(markdown: str, *cells: str) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith("| " + " | ".join(cells) + " |")]
    assert len(rows) == 1, f"no single row starts with {cells}"
    return rows[0]


def test_the_record_reads_back_what_it_writes_and_names_what_it_lacks():
    data = make_downstream()
    record = DownstreamResults.from_json(copy.deepcopy(data))
    assert json.loads(record.dumps()) == data
    assert record.tasks["lambada_openai"].values() == {"acc,none": (0.3125, 0.0064), "perplexity,none": (41.5, 1.2)}
    assert record.tasks["gsm8k"].values()["bits_per_byte,none"] == (1.1, None)
    del data["tasks"]["gsm8k"]["documents"], data["lm_eval_version"]
    with pytest.raises(ValueError, match="lm_eval_version, tasks.gsm8k.documents"):
        DownstreamResults.from_json(data)


def test_the_downstream_section_sits_beside_the_bounds(tmp_path):
    files = write_report(make_results(), tmp_path, downstream=DownstreamResults.from_json(make_downstream(step=9000)))
    markdown = files.markdown.read_text()
    assert markdown.index("## Results") < markdown.index("## Downstream tasks") < markdown.index("## Protocol")
    assert "0.3125" in _row(markdown, "lambada_openai", "`acc,none`")
    assert "5,153" in _row(markdown, "lambada_openai", "`acc,none`")           # 500 of the task's 5,153
    assert "-3.7257 | 0.0421 | 1.9300 | 3 |" in _row(markdown, "lambada_openai", "500")
    assert "N/A" not in markdown and "n/a" in _row(markdown, "gsm8k", "`bits_per_byte,none`")
    assert "Monte Carlo lower bound" in markdown
    assert "step 9,000; the bounds above, step 12,000" in markdown
    assert "lambada_openai" in files.html.read_text()


def test_downstream_tasks_alone_make_a_report_without_results_json(tmp_path):
    files = write_report(None, tmp_path, downstream=DownstreamResults.from_json(make_downstream("autoregressive")))
    markdown = files.markdown.read_text()
    assert files.json is None and not (tmp_path / JSON_NAME).exists()
    assert "## Downstream tasks" in markdown and "## Results" not in markdown
    assert "0 (exact)" in _row(markdown, "lambada_openai", "500") and "exact (autoregressive)" in markdown
    with pytest.raises(ValueError, match="needs results, downstream results, or both"):
        write_report(None, tmp_path)


def test_mlflow_names_drop_lm_eval_s_none_filter_and_keep_the_others():
    metrics = downstream_metrics(DownstreamResults.from_json(make_downstream()))
    assert metrics == {
        "lm_eval/lambada_openai/acc": 0.3125, "lm_eval/lambada_openai/acc_stderr": 0.0064,
        "lm_eval/lambada_openai/perplexity": 41.5, "lm_eval/lambada_openai/perplexity_stderr": 1.2,
        "lm_eval/lambada_openai/mean_log_likelihood": -3.7257, "lm_eval/lambada_openai/monte_carlo_error": 0.0421,
        "lm_eval/gsm8k/exact_match_strict-match": 0.02, "lm_eval/gsm8k/exact_match_strict-match_stderr": 0.004,
        "lm_eval/gsm8k/bits_per_byte": 1.1}

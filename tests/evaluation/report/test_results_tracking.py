"""The MLflow record of an evaluation (``evaluation.report.results_tracking``): the metric names of
downstream tasks, and of datasets named by any file name, logged to a real server. (An evaluation
tracked end to end: tests/evaluation/test_zero_shot.py and tests/evaluation/downstream/test_run.py.)"""

from mlflow.tracking import MlflowClient

from evaluation.report.results_tracking import downstream_metrics, metric_parts, track_results
from evaluation.results import DownstreamResults, EvalResults
from tests.support.results_fixtures import dataset_record, make_downstream, make_results


def test_mlflow_names_drop_lm_eval_s_none_filter_and_keep_the_others():
    metrics = downstream_metrics(DownstreamResults.from_json(make_downstream()))
    assert metrics == {
        "lm_eval/lambada_openai/acc": 0.3125, "lm_eval/lambada_openai/acc_stderr": 0.0064,
        "lm_eval/lambada_openai/perplexity": 41.5, "lm_eval/lambada_openai/perplexity_stderr": 1.2,
        "lm_eval/lambada_openai/mean_log_likelihood": -3.7257, "lm_eval/lambada_openai/monte_carlo_error": 0.0421,
        "lm_eval/gsm8k/exact_match_strict-match": 0.02, "lm_eval/gsm8k/exact_match_strict-match_stderr": 0.004,
        "lm_eval/gsm8k/bits_per_byte": 1.1}


def test_every_dataset_reaches_mlflow_whatever_its_file_name(mlflow_server, tmp_path):
    """A file name MLflow would refuse as a metric name (an accent, a check mark, parentheses,
    dots, 300 characters) costs nothing: every dataset is logged, under a distinct valid name,
    and one that had to change is tagged with its own."""
    names = ["val", "données ✓_entrée 1.txt", "scores (final).txt", "a(b).txt", "a)b(.txt", "..", "x" * 300]
    raw = make_results(samples=False)
    raw["datasets"] = {name: dataset_record(name, 3.0 + index / 8, 0.01, 1000, 4000, False)
                       for index, name in enumerate(names)}
    tracking = track_results(EvalResults.from_json(raw), run_dir=None, out_dir=tmp_path / "report",
                             tracking_uri=mlflow_server)
    assert tracking is not None, "the evaluation is in MLflow"
    logged = MlflowClient(mlflow_server).get_run(tracking.record.run_id).data
    bounds = {key: value for key, value in logged.metrics.items() if key.endswith("/nelbo_per_token")}
    assert len(bounds) == len(names) and logged.metrics["eval/val/nelbo_per_token"] == 3.0
    parts = metric_parts(names)
    for index, name in enumerate(names):
        assert bounds[f"eval/{parts[name]}/nelbo_per_token"] == 3.0 + index / 8, name
        assert parts[name] == name or logged.tags[f"eval/{parts[name]}/dataset"] == name
    assert parts["données ✓_entrée 1.txt"] == "donn_es __entr_e 1.txt" and parts["val"] == "val"
    assert parts["a(b).txt"] != parts["a)b(.txt"] and parts[".."].startswith("_")

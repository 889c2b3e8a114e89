"""The MLflow record of an evaluation (``evaluation.report.results_tracking``): the metric names of
downstream tasks. (Tracking to a real server: tests/evaluation/test_zero_shot.py and
tests/evaluation/downstream/test_run.py.)"""

from evaluation.report.results_tracking import downstream_metrics
from evaluation.results import DownstreamResults
from tests.support.results_fixtures import make_downstream


def test_mlflow_names_drop_lm_eval_s_none_filter_and_keep_the_others():
    metrics = downstream_metrics(DownstreamResults.from_json(make_downstream()))
    assert metrics == {
        "lm_eval/lambada_openai/acc": 0.3125, "lm_eval/lambada_openai/acc_stderr": 0.0064,
        "lm_eval/lambada_openai/perplexity": 41.5, "lm_eval/lambada_openai/perplexity_stderr": 1.2,
        "lm_eval/lambada_openai/mean_log_likelihood": -3.7257, "lm_eval/lambada_openai/monte_carlo_error": 0.0421,
        "lm_eval/gsm8k/exact_match_strict-match": 0.02, "lm_eval/gsm8k/exact_match_strict-match_stderr": 0.004,
        "lm_eval/gsm8k/bits_per_byte": 1.1}

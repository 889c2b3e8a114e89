"""The JSON objects of a results.json (``make_results``) and a downstream.json (``make_downstream``)
as ``unmask eval`` and ``unmask lm-eval`` write them, with made-up numbers: what the report and
output tests write reports from without running an evaluation."""

import math

from evaluation.bounds.estimator import Z_95

SAMPLE_TEXT = 'The <script>alert("x")</script> & more\n\nsecond paragraph'
SHA = "ab" * 32


def dataset_record(name: str, nelbo: float, se: float, tokens: int, utf8_bytes: int,
                    per_t: bool) -> dict:
    low, high = math.exp(nelbo - Z_95 * se), math.exp(nelbo + Z_95 * se)
    record = {
        "dataset": {"name": name, "split": "test", "path": f"/data/{name}/test.txt",
                    "sha256": SHA, "detokenizer": name, "unit": "sentence per line",
                    "documents": 100, "dropped_empty": 0, "utf8_bytes": utf8_bytes, "protocol": "unmask"},
        "estimate": {"nelbo_per_token": nelbo, "standard_error": se, "num_tokens": tokens,
                     "num_blocks": 10, "samples_per_block": 16, "kind": "continuous",
                     "discrete_steps": None, "seed": 0, "error_method": "replicates",
                     "perplexity_bound": math.exp(nelbo), "perplexity_interval_95": [low, high],
                     "degrees_of_freedom": 15},
        "perplexity_bound": math.exp(nelbo), "perplexity_interval": [low, high],
        "nelbo_per_token": nelbo, "standard_error": se,
        "bits_per_byte": nelbo * tokens / (math.log(2) * utf8_bytes), "num_tokens": tokens,
    }
    if per_t:
        t = [(i + 0.5) / 64 for i in range(64)]
        record["per_t"] = {"t": t, "contribution": [nelbo * (1 + 0.5 * (x - 0.5)) for x in t]}
    return record


def make_results(objective: str = "diffusion", *, per_t: bool = True, samples: bool = True) -> dict:
    return {
        "model": {"path": "/runs/small/export", "objective": objective, "step": 12000,
                  "tokens_seen": 6_291_456_000, "weights": "ema",
                  "network": {"n_layers": 12, "d_model": 768, "n_heads": 12, "vocab_size": 50258,
                              "max_seq_len": 1024},
                  "tokenizer": {"kind": "gpt2-bpe", "sha256": SHA, "vocab_size": 50258}},
        "protocol": {"name": "unmask", "seq_len": 1024, "samples_per_block": 16, "seed": 0,
                     "estimator": "autoregressive" if objective == "autoregressive" else "continuous",
                     "discrete_steps": None, "target_rel_error": 0.002, "add_eos": True, "split": "test",
                     "max_documents": None, "wrapping": "documents + EOS concatenated | cut into blocks",
                     "bound": "continuous-time NELBO with both endpoint terms",
                     "precision": "float32 weights; sums float64", "world_size": 2},
        "datasets": {
            "lambada": dataset_record("lambada", 3.5, 0.01, 245_569, 1_000_000, per_t),
            "wikitext2": dataset_record("wikitext2", 3.25, 0.02, 287_644, 1_234_567, False),
        },
        "samples": [{"text": SAMPLE_TEXT, "network_calls": 128}] if samples else [],
        "mlflow": {"tracking_uri": "http://127.0.0.1:5000", "run_id": "0123abcd"},
        "created": "2025-01-02T03:04:05+00:00", "unmask_version": "0.1.0", "git_commit": "deadbeef",
    }


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

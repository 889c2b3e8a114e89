"""``bench/train_gpu.py`` runs on CPU and reports every field: each training variant, the
evaluation untuned and tuned, the samplers and lm-eval."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.cli_runner import CLI_TIMEOUT_S, cli_env
from tests.support.paths import GPT2, REPO, TINY, require_shared

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN_FIELDS = {"preset", "variant", "micro_batch", "seq_len", "vocab_size", "logit_columns", "compile", "attention",
                "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "loader_wait_share"}


@pytest.mark.slow
def test_gpu_bench_smoke_runs_on_cpu_and_reports_every_field(tmp_path):
    source = require_shared(TINY, GPT2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(source.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    variants = ["pipeline-zero1", "pipeline-zero2+no-pin+sync", "torch", "torch+chunked-ce", "torch+full-logits",
                "torch+checkpointing", "torch+math-attention+foreach-adamw", "torch+bd3-4",
                "pipeline-zero1+adapt-gpt2+annealed", "torch+adapt-gpt2+bd3-4"]
    proc = subprocess.run(
        [sys.executable, "bench/train_gpu.py", "--device", "cpu", "--presets", "tiny", "--steps", "2",
         "--warmup", "1", "--micro-batches", "2", "--seq-len", "32", "--inputs", str(corpus), "--variants",
         *variants, "--eval-blocks", "2", "--repeats", "1", "--sample-batch", "2", "--chunk-rows", "16",
         "--lm-eval-requests", "4"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # DeepSpeed prints to stdout too: the bench's lines are the JSON objects.
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    train = [row for row in rows if row["bench"] == "train"]
    assert [row["variant"] for row in train] == variants
    assert [row["attention"] for row in train] == ["flash"] * 6 + ["math"] + ["flash"] * 3  # auto's CPU choice
    assert [row["block_size"] for row in train] == [None] * 7 + [4, None, 4]  # block diffusion: the dense mask on CPU
    # A GPT-2 of the preset's shape written with transformers, read and adapted as --init-from does;
    # +annealed: every timed step inside the annealing.
    assert [(row["adapted_from"], row["anneal_steps"]) for row in train] == [(None, None)] * 8 + [
        ("gpt2", 1_000_000), ("gpt2", 0)]
    for row in train:
        assert TRAIN_FIELDS <= row.keys() and row["tokens_per_s"] > 0 and row["mfu"] is None, row
        assert row["peak_memory_bytes"] is None  # CUDA only
        assert 0 < row["host_rss_bytes"] <= row["host_peak_rss_bytes"], row
        waits = row["loader_wait_share"]
        assert (0 <= waits < 1) if row["variant"].startswith("pipeline") else waits is None, row
    evaluations = [row for row in rows if row["bench"] == "evaluate"]
    assert [row["tuned"] for row in evaluations] == [False, True]  # a fixed --eval-batch, then sized to the device
    for evaluation in evaluations:
        assert evaluation["estimate_tokens_per_s_per_sample"] > 0 and evaluation["seq_len"] == 32
    samples = [row for row in rows if row["bench"] == "sample"]
    # No compile on CPU; then fast generation's rows: blocks of 4 tokens with the same budget (125
    # calls per block) without and with the prefix cache, whole-sequence without and with the dual
    # cache, and the autoregressive network's KV cache.
    assert [(row["sampler"], row.get("block_len"), row.get("prefix_cache"), row.get("whole_sequence"),
             row.get("dual_cache"), row["compiled"], row["steps"]) for row in samples] == [
        ("ancestral", None, None, False, None, False, 1000), ("first-hitting", None, None, False, None, False, 1000),
        ("first-hitting", 4, None, False, None, False, 125), ("first-hitting", 4, 4, False, None, False, 125),
        ("first-hitting", 4, None, True, None, False, 125), ("first-hitting", 4, None, True, 4, False, 125),
        ("autoregressive", None, None, None, None, False, 32)]
    for sample in samples:
        assert sample["sequences_per_s"] > 0 and sample["tokens_per_s"] > 0
        assert sample["rows_evaluated"] <= 2 * 32  # at most one evaluation per generated token
        assert sample["utilization"] is None      # no peak on CPU
    assert [sample["network_calls"] for sample in samples[1:]] == [32] * 6   # one call per token
    (lm_eval,) = [row for row in rows if row["bench"] == "lm-eval"]
    assert lm_eval["requests"] == 4 and lm_eval["requests_per_s"] > 0

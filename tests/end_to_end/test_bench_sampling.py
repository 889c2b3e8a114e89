"""The sampling benchmarks run and report what the lead reads: ``bench/sampling_cpu.py`` every
sampler's network calls per sequence and its speed against the ancestral sampler measured in the
same run; ``bench/sampler_quality.py`` the quality of every sampler at every budget."""

import json
import subprocess
import sys

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from tests.support.cli_runner import cli_env
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import REPO

BATCH, SEQ_LEN, STEPS = 2, 8, 32


def test_sampling_bench_reports_every_sampler_against_ancestral():
    proc = subprocess.run([sys.executable, "bench/sampling_cpu.py", "--steps", "4", str(STEPS), "--batch", str(BATCH),
                           "--seq-len", str(SEQ_LEN), "--repeats", "1"], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    machine, *rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert machine["preset"] == "tiny" and machine["cpus"] >= 1
    at = {(row["steps"], row["variant"]): row for row in rows}
    assert {variant for _, variant in at} == {"ancestral-no-cache", "ancestral", "first-hitting", "confidence",
                                              "remdm"}
    assert at[STEPS, "ancestral-no-cache"]["rows_evaluated"] == BATCH * STEPS
    assert at[STEPS, "ancestral"]["rows_evaluated"] <= BATCH * SEQ_LEN < BATCH * STEPS
    assert at[STEPS, "first-hitting"]["calls_per_sequence"] == SEQ_LEN   # exact: one call per token
    assert at[4, "first-hitting"]["calls_per_sequence"] == 4             # 2 tokens per call
    assert at[4, "confidence"]["calls_per_sequence"] == 4
    assert at[STEPS, "remdm"]["calls_per_sequence"] <= STEPS
    assert all(row["speedup_vs_ancestral"] == 1.0 for row in rows if row["variant"] == "ancestral")
    assert all(row["sequences_per_s"] > 0 for row in rows)


def test_sampler_quality_bench_prints_rows_and_the_table(tmp_path):
    """``bench/sampler_quality.py`` on untrained exports: a row per (sampler, budget) and seed,
    the reference's own samples as the baseline row, then the Markdown table."""
    text = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300)]
    tokenizer = train_sentencepiece(text, tmp_path / "tok", vocab_size=300)
    diffusion = write_untrained_export(tmp_path / "d" / "export", tokenizer, tmp_path / "tok", max_seq_len=16)
    reference = write_untrained_export(tmp_path / "ar" / "export", tokenizer, tmp_path / "tok",
                                       objective="autoregressive", max_seq_len=16)
    proc = subprocess.run([sys.executable, "bench/sampler_quality.py", "--diffusion", str(diffusion), "--reference",
                           str(reference), "--num", "2", "--seeds", "0", "1", "--budgets", "4", "32", "--samplers",
                           "first-hitting", "remdm"], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    setup, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:] if line.startswith("{")]
    assert setup["seq_len"] == 16 and setup["samplers"] == ["first-hitting", "remdm"]
    scored = [row for row in rows if "sampler" in row]
    assert [(r["seed"], r["sampler"], r["budget"]) for r in scored] == [
        (seed, sampler, budget) for seed in (0, 1) for sampler, budget in
        (("first-hitting", 4), ("first-hitting", 32), ("remdm", 4), ("remdm", 32), ("autoregressive (the reference)", 16))]
    exact = [r["network_calls"] for r in scored if r["sampler"] == "first-hitting"]
    assert exact == [4, 16, 4, 16] and all(r["generative_perplexity"] > 1 for r in scored)
    assert "| first-hitting | 32 | 16.0 |" in proc.stdout and "| autoregressive (the reference) | 16 | 16.0 |" in proc.stdout


def test_sampler_quality_bench_measures_fast_generation_and_the_caches_drift(tmp_path):
    """``--fast``: the prefix and dual caches' KL to the exact distributions is 0 when they refresh at
    every call and positive when they do not; each row gives calls, tokens per call, seconds and a
    perplexity inside its interval; guided rows continue --prompt at two calls a step."""
    text = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300)]
    tokenizer = train_sentencepiece(text, tmp_path / "tok", vocab_size=300)
    # Two layers: with one, the context's keys and values are its embeddings', which no block changes.
    diffusion = write_untrained_export(tmp_path / "d" / "export", tokenizer, tmp_path / "tok", max_seq_len=32,
                                       n_layers=2)
    reference = write_untrained_export(tmp_path / "ar" / "export", tokenizer, tmp_path / "tok",
                                       objective="autoregressive", max_seq_len=32)
    proc = subprocess.run([sys.executable, "bench/sampler_quality.py", "--diffusion", str(diffusion), "--reference",
                           str(reference), "--num", "2", "--fast", "--prompt", "the quick", "--plans", "threshold 0",
                           "first-hitting, blocks of 16, prefix cache 4", "first-hitting after the prompt, guidance 1",
                           "autoregressive (the reference)", "ancestral 4", "--drift-plans", "prefix cache 1", "prefix cache 2",
                           "prefix cache 16", "dual cache 1", "dual cache 16"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()[1:] if line.startswith("{")]
    drift = {row["cache"]: row for row in rows if "cache" in row}
    assert drift["prefix cache 1"]["mean_kl_nats"] == 0.0 and drift["prefix cache 16"]["mean_kl_nats"] > 0.0
    assert drift["prefix cache 16"]["share_of_stale_predictions"] > drift["prefix cache 2"][
        "share_of_stale_predictions"] > 0
    assert drift["dual cache 1"]["mean_kl_nats"] == 0.0 and drift["dual cache 16"]["mean_kl_nats"] > 0.0
    threshold, cached, guided, autoregressive, ancestral = [row for row in rows if "plan" in row]
    prompt_tokens = len(tokenizer.encode("the quick"))
    # Guidance: two calls a step, over the positions after the prompt only.
    assert guided["network_calls"] == 2 * (32 - prompt_tokens) and guided["tokens_per_call"] == 0.5
    assert autoregressive["network_calls"] == 32 and autoregressive["tokens_per_call"] == 1
    assert threshold["network_calls"] == 1 and threshold["tokens_per_call"] == 32   # threshold 0: all at once
    assert cached["network_calls"] == 32                                            # exact first-hitting: one a token
    assert ancestral["plan"] == "ancestral 4" and ancestral["network_calls"] <= 4   # a distilled student's plan
    for row in (threshold, cached, ancestral):
        assert row["interval"][0] <= row["generative_perplexity"] <= row["interval"][1]
    assert "| threshold 0 (seed 0) | 1.0 | 32.0 |" in proc.stdout and "dual cache 16: refresh every 16: mean KL" in proc.stdout

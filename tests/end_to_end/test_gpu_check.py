"""``bench/gpu_check.sh``, the one command a lent GPU runs, dry-run on CPU (tiny preset, a step
or two per stage) so that it cannot rot between devices: the user's path (every command after
prep), every bench stage, the budget that keeps it to one call, and the files the team reads back."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support.cli_runner import cli_env
from tests.support.paths import GPT2, REPO, TINY

# A dry run is a few dozen processes, some starting DeepSpeed; minutes on two busy cores.
DRY_RUN_TIMEOUT_S = 1500
E2E_STEPS = ["e2e-train", "e2e-init-from", "e2e-export", "e2e-export-hf", "e2e-eval", "e2e-sample-ancestral",
             "e2e-sample-first-hitting", "e2e-sample-confidence", "e2e-sample-remdm", "e2e-sample-blocks",
             "e2e-sample-threshold", "e2e-sample-prefix-cache", "e2e-sample-dual-cache", "e2e-distill",
             "e2e-export-distilled", "e2e-sample-distilled", "e2e-eval-suite",
             "e2e-bd3lm-tokenizer", "e2e-import-bd3lm", "e2e-sample-bd3lm", "e2e-lm-eval", "e2e-hf-load",
             "e2e-train-documents", "e2e-eval-documents"]
ADAPT_STEPS = ["adapt-source", "adapt-prep", "adapt-train", "adapt-export", "adapt-sample", "adapt-bench"]
MAX_OUT_FILES = 8   # what a device call brings back from $OUT (../shared/gpu/README.md)


def _ptb_layout(root: Path) -> Path:
    """Sentences in ../shared/data's PTB layout, for the local lm-eval task of the dry run."""
    lines = [line.strip() for line in TINY.read_text(encoding="utf-8").splitlines() if len(line.split()) >= 8]
    (root / "ptb").mkdir(parents=True)
    (root / "ptb" / "ptb.test.txt").write_text("\n".join(lines[:100]) + "\n", encoding="utf-8")
    return root


def _check(tmp_path: Path, shards: Path, *options: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {**cli_env(), "PYTHON": sys.executable, "OUT": str(out)}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--device", "cpu", "--data", str(shards),
                           "--eval-data", str(_ptb_layout(tmp_path / "data")), "--gpt2-tokenizer", str(GPT2), *options],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    return done, out


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)  # the dry run's own limit, not the suite's 600 s per test
def test_the_gpu_check_dry_runs_on_cpu_and_writes_every_result(tmp_path, tinyshakespeare_shards):
    done, out = _check(tmp_path, tinyshakespeare_shards)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s["timed_out"], s.get("skipped", False)) for s in steps] == [
        (name, 0, False, False) for name in [*E2E_STEPS, "inference", "tests", *ADAPT_STEPS, "train", "bench", "scale",
                                             "fp8", "checkpoint"]]
    assert json.loads((out / "environment.json").read_text())["attention_kernels"] == ["flash", "math"]
    for name in ("train.json", "e2e-train.json", "e2e-train-documents.json", "adapt-train.json"):
        train = json.loads((out / name).read_text())
        assert train["step"] == 2 and train["tokens_per_s"] > 0 and train["mfu"] is None  # no MFU without a peak
    with tarfile.open(out / "logs.tar.gz") as packed:
        logs = {Path(member.name).name: packed.extractfile(member).read().decode() for member in packed
                if member.isfile()}
    assert "micro-batch 16 (auto) x 1 accumulation" in logs["train.log"]
    assert "step 1 validation" in logs["e2e-train.log"] and "checkpoint" in logs["e2e-train.log"]
    assert "optimizer state fresh, EMA from these weights" in logs["e2e-init-from.log"]
    assert "distillation: 2 round(s) of 1 steps" in logs["e2e-distill.log"] and "----- sample 2 " in logs[
        "e2e-sample-distilled.log"]
    assert json.loads(logs["e2e-distill.json"])["step"] == 2
    assert "samples: mean unigram entropy" in logs["e2e-eval.log"]
    assert "protocol: bd3lm" in logs["e2e-eval-suite.log"] and "arxiv: not scored (test split)" in logs["e2e-eval-suite.log"]
    assert "ptb_word_order: acc" in logs["e2e-lm-eval.log"]
    assert "imported BD3-LM's model" in logs["e2e-import-bd3lm.log"] and "----- sample 2 " in logs["e2e-sample-bd3lm.log"]
    loaded = json.loads(logs["e2e-hf-load.log"].strip().splitlines()[-1])
    assert loaded["hf_load"] == "UnmaskForMaskedLM" and loaded["max_abs_logit_difference"] < 1e-3
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    trained = [row["variant"] for row in rows if row["bench"] == "train"]
    # Adapting: our network, the adapted GPT-2 and the same annealed (on the adapted data); then the bench step's;
    # then scale (large and xl on a GPU), then fp8 with and without (refused on CPU: a row that says why).
    assert trained == ["pipeline-zero1", "pipeline-zero1+adapt-gpt2", "pipeline-zero1+adapt-gpt2+annealed",
                       "pipeline-zero1+eager+unpadded+flash", "pipeline-zero1", "pipeline-zero1", "pipeline-zero1",
                       "pipeline-zero1+fp8"]
    assert [row["adapted_from"] for row in rows if row["bench"] == "train"] == [None, "gpt2", "gpt2", *[None] * 5]
    assert "adaptation" in logs["adapt-train.log"] and "mean unigram entropy" in logs["adapt-sample.log"]
    fp8 = rows[[row.get("variant") for row in rows].index("pipeline-zero1+fp8")]
    assert "train.float8 = true: FP8 matmuls need a CUDA GPU" in fp8["error"]
    assert all(row["tokens_per_s"] > 0 and row["estimated_memory_bytes"] > 0 for row in rows
               if row["bench"] == "train" and "error" not in row)
    stalls = [row for row in rows if row["bench"] == "checkpoint"]
    assert [row["config"] for row in stalls] == ["synchronous", "asynchronous"]
    assert all(row["checkpoints"] == 1 and row["checkpoint_mb"] > 0 for row in stalls)
    evaluated = [row for row in rows if row["bench"] == "evaluate"]
    assert [row["tuned"] for row in evaluated] == [False, True]
    assert all(0 < row["utilization"] < row["utilization_2n_4ldt"] for row in evaluated)   # the head on half the rows
    sampled = [row for row in rows if row["bench"] == "sample"]
    # Then blocks, the prefix cache, whole-sequence blocks, the dual cache and AR's KV cache.
    assert [(row["sampler"], row.get("prefix_cache"), row.get("dual_cache"), row["compiled"]) for row in sampled] == [
        ("ancestral", None, None, False), ("first-hitting", None, None, False), ("first-hitting", None, None, False),
        ("first-hitting", 4, None, False), ("first-hitting", None, None, False), ("first-hitting", None, 4, False),
        ("autoregressive", None, None, False)]
    for row in sampled:   # the budget is per block in blocks, whose calls read less than the sequence: no utilization
        blocks = row["seq_len"] // row["block_len"] if row.get("block_len") else 1
        assert row["network_calls"] <= row["steps"] * blocks and row["tokens_per_s"] > 0, row
        assert row["utilization"] is None if row.get("block_len") else row["utilization"] > 0, row
    (lm_eval,) = [row for row in rows if row["bench"] == "lm-eval"]
    assert lm_eval["requests_per_s"] > 0
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= MAX_OUT_FILES, files
    assert not any(path.name.startswith("step-") for path in out.rglob("*")), "checkpoints stay off $OUT"


def test_steps_past_the_budget_are_skipped_and_recorded(tmp_path):
    done, out = _check(tmp_path, tmp_path / "no-shards", "--budget", "0", "--steps", "e2e,tests")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s["skipped"]) for s in steps] == [(name, None, True) for name in [*E2E_STEPS, "tests"]]

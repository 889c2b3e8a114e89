"""``bench/sampling_cpu.py`` runs and reports what the lead reads: every sampler's network calls
per sequence and its speed against the ancestral sampler measured in the same run."""

import json
import subprocess
import sys

from tests.cli_runner import cli_env
from tests.paths import REPO

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

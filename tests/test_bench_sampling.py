"""``bench/sampling_cpu.py`` runs and reports what BENCHMARKS.md reads: cached sampling evaluates
each sequence at most seq_len times however many steps, the uncached reference every step."""

import json
import subprocess
import sys

from tests.cli_runner import cli_env
from tests.paths import REPO

BATCH, SEQ_LEN, STEPS = 2, 8, 32


def test_sampling_bench_reports_cache_and_no_cache():
    proc = subprocess.run([sys.executable, "bench/sampling_cpu.py", "--steps", str(STEPS), "--batch", str(BATCH),
                           "--seq-len", str(SEQ_LEN), "--repeats", "1"], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    machine, *rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert machine["preset"] == "tiny" and machine["cpus"] >= 1
    by_variant = {row["variant"]: row for row in rows}
    assert set(by_variant) == {"cache", "no_cache"}
    assert by_variant["no_cache"]["rows_evaluated"] == BATCH * STEPS
    assert by_variant["cache"]["rows_evaluated"] <= BATCH * SEQ_LEN < BATCH * STEPS
    assert by_variant["no_cache"]["speedup_vs_no_cache"] == 1.0
    assert all(row["sequences_per_s"] > 0 for row in rows)

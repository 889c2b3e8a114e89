"""``bench/gpu_check.sh``, the one command a lent GPU runs, dry-run on CPU (tiny preset, a step
or two per stage) so that it cannot rot between devices: every stage runs, and writes the
JSON lines the team reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_runner import cli_env
from tests.paths import REPO

pytestmark = pytest.mark.slow

# A dry run is a few processes that start DeepSpeed; minutes at most on two busy cores.
DRY_RUN_TIMEOUT_S = 900


def test_the_gpu_check_dry_runs_on_cpu_and_writes_every_result(tmp_path, tinyshakespeare_shards):
    out = tmp_path / "out"
    env = {**cli_env(), "PYTHON": sys.executable, "OUT": str(out)}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--device", "cpu", "--data", str(tinyshakespeare_shards)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s["timed_out"]) for s in steps] == [
        ("train", 0, False), ("tests", 0, False), ("bench", 0, False), ("inference", 0, False)]
    assert json.loads((out / "environment.json").read_text())["attention_kernels"] == ["flash", "math"]
    train = json.loads((out / "train.json").read_text())
    assert train["step"] == 2 and train["tokens_per_s"] > 0 and train["mfu"] is None  # no MFU without a GPU peak
    assert "micro-batch 16 (auto) x 1 accumulation" in (out / "train.log").read_text()
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    trained = [row["variant"] for row in rows if row["bench"] == "train"]
    assert trained == ["pipeline-zero1+eager+unpadded+flash", "pipeline-zero1"]
    assert all(row["tokens_per_s"] > 0 for row in rows if row["bench"] == "train")
    assert [row["tuned"] for row in rows if row["bench"] == "evaluate"] == [False, True]
    assert [row["tuned"] for row in rows if row["bench"] == "sample"] == [False, True]
    for name in ("train", "tests", "bench", "inference"):
        assert (out / f"{name}.log").stat().st_size > 0
    assert not any(path.name.startswith("step-") for path in out.rglob("*")), "checkpoints stay off $OUT"

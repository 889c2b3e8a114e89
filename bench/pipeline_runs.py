"""What the comparison benches share: the `tiny` recipe they all train with, and `unmask`
commands run as a user runs them (a subprocess of this checkout), failing loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_recipe(steps: int, global_batch: int, seed: int, *, base: str = "tiny", model: dict | None = None) -> dict:
    """The `tiny` recipe (configs/tiny.yaml, or ``base``), ``steps`` long, validated and
    checkpointed once at the end; a comparison varies only ``model``."""
    return {
        "base": base,
        "model": model or {},
        "train": {"max_steps": steps, "global_batch_size": global_batch, "seed": seed, "zero_stage": 1},
        "optim": {"warmup_steps": max(1, steps // 10)},
        "eval": {"every": steps, "batches": 8},
        "checkpoint": {"every": steps},
        "logging": {"every": 10, "progress": False, "mlflow": False},
        "data": {"num_workers": 1},
    }


def run_unmask(args: list[str], *, threads: int) -> str:
    """``unmask ARGS`` with ``threads`` OpenMP threads; its stdout, or SystemExit with its stderr's tail."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-m", "orchestration.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"unmask {' '.join(args[:2])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout

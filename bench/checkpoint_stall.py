"""The stall of a checkpoint, synchronous and asynchronous (``checkpoint.asynchronous``; prints JSON lines).

Each configuration runs `unmask train` on the same shards, logging every step and checkpointing
every ``--every`` steps, and reads ``train/step_time`` from metrics.jsonl. A save runs after the
log of its step, so its stall lands in the next step's time: the stall is the mean time of the
steps right after a checkpoint minus the median of the steps that neither follow one nor are
the first ``--warmup``. "during write" is the median of the other steps of each checkpoint
interval, where an asynchronous write competes with the loop for the CPU. ``loop_waited_s`` is
the trainer's own ``checkpoint/stall_s``: the time the loop spent in the save call (for an
asynchronous save, the snapshot and any wait for the save before), the final save excluded.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \\
        --out /tmp/ts --seq-len 64 --vocab-size 384
    .venv/bin/python bench/checkpoint_stall.py --data /tmp/ts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _config(args: argparse.Namespace, root: Path, asynchronous: bool) -> Path:
    model = {"preset": args.preset, **({"n_layers": args.layers} if args.layers else {}),
             **({"d_model": args.d_model, "n_heads": 4} if args.d_model else {})}
    config = {"model": model,
              "train": {"max_steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                        "compile": False},  # the same kernels in both runs, without minutes of compiling
              "optim": {"lr": 1.0e-3, "warmup_steps": 2}, "eval": {"every": 0, "batches": 1},
              "checkpoint": {"every": args.every, "keep_last": 2, "asynchronous": asynchronous},
              "data": {"num_workers": 0}, "logging": {"every": 1, "progress": False, "mlflow": False}}
    path = root / f"config-{asynchronous}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _checkpoint_bytes(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return sum(path.stat().st_size for path in latest.rglob("*") if path.is_file())


def run(args: argparse.Namespace, root: Path, asynchronous: bool) -> dict:
    run_dir = root / f"run-{asynchronous}"
    command = [sys.executable, "-m", "orchestration.cli", "train", "--config", str(_config(args, root, asynchronous)),
               "--data", args.data, "--run-dir", str(run_dir)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"asynchronous={asynchronous} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["train/step_time"] for r in records if "train/step_time" in r}
    follows = {s for s in times if s - 1 >= args.every and (s - 1) % args.every == 0}  # a save ran before it
    after = [times[s] for s in sorted(follows)]
    during = [t for s, t in times.items() if s > args.warmup and s not in follows]
    base = statistics.median(during)
    waited = [r["checkpoint/stall_s"] for r in records if "checkpoint/stall_s" in r and r["step"] < args.steps]
    return {"bench": "checkpoint", "config": "asynchronous" if asynchronous else "synchronous",
            "checkpoints": len(after), "loop_waited_s": statistics.fmean(waited),
            "checkpoint_mb": _checkpoint_bytes(run_dir) / 1e6, "step_after_checkpoint_s": statistics.fmean(after),
            "step_during_write_s": base, "stall_s": statistics.fmean(after) - base, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="shards from `unmask prep`")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=6, help="0: the preset's")
    parser.add_argument("--d-model", type=int, default=512, help="0: the preset's")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    parser.add_argument("--root", help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "preset": args.preset}))
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for asynchronous in (False, True):
            print(json.dumps(run(args, Path(tmp), asynchronous)), flush=True)
            shutil.rmtree(Path(tmp) / f"run-{asynchronous}")  # a medium run's checkpoints are 6 GB each


if __name__ == "__main__":
    main()

"""MDLM against block diffusion (BD3-LM) on the same data and budget.

Trains the `tiny` preset through the real pipeline (`unmask train`, one process, CPU) once
per block size, every run with the same config (steps, batch, learning rate, seed) but
``model.block_size`` (none: MDLM), then scores each EMA export on the held-out split with
`unmask eval --datasets val` (the full bound, K time samples per block, its standard error)
and draws samples with the first-hitting sampler (their mean unigram entropy; a block model
through its KV cache). The paper's ordering, at 524B tokens: BD3 L' = 4 < 16 < MDLM.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \\
        --out /tmp/ts --seq-len 128 --vocab-size 1024 --val-fraction 0.05
    .venv/bin/python bench/block_comparison.py --data /tmp/ts --steps 200

Prints one JSON object per model and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SEED = 0


def _config(args: argparse.Namespace, block_size: int | None) -> dict:
    """The `tiny` recipe (configs/tiny.yaml), ``args.steps`` long; only the block size differs."""
    return {
        "base": "tiny",
        "model": {"block_size": block_size},
        "train": {"max_steps": args.steps, "global_batch_size": args.global_batch, "seed": SEED, "zero_stage": 1},
        "optim": {"warmup_steps": max(1, args.steps // 10)},
        "eval": {"every": args.steps, "batches": 8},
        "checkpoint": {"every": args.steps},
        "logging": {"every": 10, "progress": False, "mlflow": False},
        "data": {"num_workers": 1},
    }


def _unmask(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "orchestration.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"unmask {' '.join(args[:2])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def compare(args: argparse.Namespace, block_size: int | None, root: Path) -> dict:
    """Train, export, score and sample one model."""
    name = "mdlm" if block_size is None else f"bd3-{block_size}"
    config, run_dir = root / f"{name}.yaml", root / name
    config.write_text(yaml.safe_dump(_config(args, block_size)))
    _unmask(["train", "--config", str(config), "--data", args.data, "--run-dir", str(run_dir)])
    _unmask(["eval", str(run_dir), "--datasets", "val", "--shards", args.data, "--samples", str(args.samples),
             "--seed", str(SEED), "--mlflow-uri", f"sqlite:///{root / 'mlflow.db'}"])
    val = json.loads((run_dir / "report" / "results.json").read_text())["datasets"]["val"]
    samples = root / f"{name}.jsonl"
    _unmask(["sample", str(run_dir), "--num", str(args.num_samples), "--sampler", "first-hitting",
             "--out", str(samples)])
    entropies = [json.loads(line)["unigram_entropy"] for line in samples.read_text().splitlines()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["train/step_time"] for r in records if "train/step_time" in r][1:]
    return {"model": name, "block_size": block_size, "steps": args.steps,
            "val_nelbo_per_token": val["nelbo_per_token"], "standard_error": val["standard_error"],
            "perplexity_bound": val["perplexity_bound"], "perplexity_interval_95": val["perplexity_interval"],
            "final_train_loss": next(r["train/loss"] for r in reversed(records) if "train/loss" in r),
            "median_step_time_s": statistics.median(step_times) if step_times else None,
            "sample_unigram_entropy": statistics.mean(entropies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an `unmask prep` output directory")
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[4, 16], help="BD3's L' (MDLM always runs)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16, help="time samples per block of the val bound")
    parser.add_argument("--num-samples", type=int, default=8, help="samples drawn from each model")
    parser.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = []
        for block_size in [None, *args.block_sizes]:
            results.append(compare(args, block_size, root))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": results}, indent=2))


if __name__ == "__main__":
    main()

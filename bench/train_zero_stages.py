"""Training throughput of each ZeRO stage through the real pipeline (`unmask train`).

Runs `unmask train` (torchrun for several processes) for every (world size, ZeRO stage)
and reads tokens/s from the run's metrics.jsonl, skipping the first logging interval
(warm-up). Prints one JSON object per configuration and a summary with each stage's time
relative to stage 1 at the same world size. Example (CPU, two processes):

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \
        --out /tmp/ts --seq-len 128 --vocab-size 512
    .venv/bin/python bench/train_zero_stages.py --data /tmp/ts --world-sizes 1 2 --preset tiny
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
sys.path.insert(0, str(REPO))

from pipeline.distributed import free_port  # noqa: E402


def _config(args: argparse.Namespace, stage: int) -> dict:
    return {
        "model": {"preset": args.preset},
        "train": {"max_steps": args.steps, "global_batch_size": args.global_batch, "zero_stage": stage,
                  "ema_decay": 0.99},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "eval": {"every": 0, "batches": 1},
        "checkpoint": {"every": 10**6},
        "logging": {"every": args.log_every, "progress": False},
        "data": {"num_workers": 1},
    }


def _command(world: int, config: Path, data: str, run_dir: Path) -> list[str]:
    train = ["-m", "orchestration.cli", "train", "--config", str(config), "--data", data, "--run-dir", str(run_dir)]
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", *train]


def measure(args: argparse.Namespace, world: int, stage: int, root: Path) -> dict:
    config = root / f"w{world}-z{stage}.yaml"
    config.write_text(yaml.safe_dump(_config(args, stage)))
    run_dir = root / f"w{world}-z{stage}"
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(_command(world, config, args.data, run_dir), cwd=REPO, env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"w{world} z{stage} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/tokens_per_second"] for r in records if "train/tokens_per_second" in r][1:]
    return {"world_size": world, "zero_stage": stage, "threads_per_rank": threads,
            "tokens_per_second": statistics.median(rates), "intervals": len(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an `unmask prep` output directory")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_sizes:
            for stage in args.stages:
                result = measure(args, world, stage, Path(tmp))
                print(json.dumps(result), flush=True)
                results.append(result)
    for result in results:
        base = next(r for r in results if r["world_size"] == result["world_size"] and r["zero_stage"] == 1)
        result["time_vs_stage1"] = base["tokens_per_second"] / result["tokens_per_second"]
    print(json.dumps({"summary": results}, indent=2))


if __name__ == "__main__":
    main()

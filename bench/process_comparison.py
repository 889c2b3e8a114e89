"""The three diffusion processes on the same data and budget: absorbing (linear schedule),
learned (GenMD4, exponents starting at linear) and uniform (D3PM, linear schedule).

Two parts; both print one JSON object per process and a summary.

``--part quality``: trains the `tiny` preset with each process through the real pipeline
(`unmask train`, one process, CPU), every run with the same config (steps, batch, learning
rate, seed) but ``model.process``, then scores its EMA export on the held-out split with
`unmask eval --datasets val` (K time samples per block: the bound, its standard error and its
95% interval; learned: the exponents' spread). The papers' ordering is learned <= absorbing <
uniform (MD4 / GenMD4 tables, seed 002).

``--part timing``: the cost of one training step of each process, measured in this process
and interleaved (the machine is noisy): the trainer's objective and trained module
(``pipeline.training.objective``, ``model.spec.build_trainable``), forward, backward and an AdamW
step on the same real batch and the same times, median over ``--repeats``; reported as a
ratio to absorbing. Run it on a quiet machine.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \\
        --out /tmp/ts --seq-len 128 --vocab-size 1024
    .venv/bin/python bench/process_comparison.py --data /tmp/ts --part quality --steps 300
    .venv/bin/python bench/process_comparison.py --data /tmp/ts --part timing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.pipeline_runs import run_unmask, tiny_recipe  # noqa: E402
from data_prep.shards.format import Manifest  # noqa: E402
from data_prep.shards.loader import StreamingLoader  # noqa: E402
from model.spec import build_trainable  # noqa: E402
from pipeline.config import ModelSection, OptimSection  # noqa: E402
from pipeline.training.build import network_config  # noqa: E402
from pipeline.training.engine import build_optimizer  # noqa: E402
from pipeline.training.objective import MicroBatchSlot, make_objective  # noqa: E402

PROCESSES = ("absorbing", "learned", "uniform")
BASELINE = "absorbing"
SEED = 0


def _config(args: argparse.Namespace, process: str) -> dict:
    """The `tiny` recipe; only the process differs (t for every process: uniform's and learned's
    best denoisers depend on it, the config check says)."""
    return tiny_recipe(args.steps, args.global_batch, SEED,
                       model={"process": process, "schedule": "linear", "time_conditioning": True})


def _unmask(args: list[str]) -> None:
    run_unmask(args, threads=os.cpu_count() or 1)


def quality(args: argparse.Namespace, process: str, root: Path) -> dict:
    """Train, export and score one process; its bound on the val split and its training record."""
    config, run_dir = root / f"{process}.yaml", root / process
    config.write_text(yaml.safe_dump(_config(args, process)))
    _unmask(["train", "--config", str(config), "--data", args.data, "--run-dir", str(run_dir)])
    _unmask(["eval", str(run_dir), "--datasets", "val", "--shards", args.data, "--samples", str(args.samples),
             "--seed", str(SEED), "--mlflow-uri", f"sqlite:///{root / 'mlflow.db'}"])
    results = json.loads((run_dir / "report" / "results.json").read_text())
    val = results["datasets"]["val"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["train/step_time"] for r in records if "train/step_time" in r]
    step_times = step_times[1:] or step_times  # after the warm-up interval
    result = {"process": process, "steps": args.steps, "val_nelbo_per_token": val["nelbo_per_token"],
              "standard_error": val["standard_error"], "perplexity_bound": val["perplexity_bound"],
              "perplexity_interval_95": val["perplexity_interval"], "bits_per_byte": val["bits_per_byte"],
              "val_tokens": val["num_tokens"], "samples_per_block": results["protocol"]["samples_per_block"],
              "final_train_loss": next(r["train/loss"] for r in reversed(records) if "train/loss" in r),
              "median_step_time_s": statistics.median(step_times)}
    if "schedule" in results:
        schedule = results["schedule"]
        result["exponents"] = {key: schedule[key] for key in ("exponent_min", "exponent_median", "exponent_max")}
        result["unmask_first"] = [entry["text"] for entry in schedule["unmask_first"]]
        result["unmask_last"] = [entry["text"] for entry in schedule["unmask_last"]]
    return result


def timing(args: argparse.Namespace) -> list[dict]:
    """Median seconds of one step (loss, backward, AdamW) per process, interleaved."""
    manifest = Manifest.read(args.data)
    network = network_config(ModelSection(preset="tiny", time_conditioning=True), manifest)
    batch = next(iter(StreamingLoader(args.data, "train", args.global_batch, rank=0, world_size=1, seed=SEED)))
    setups = {}
    for process in args.processes:
        spec = ModelSection(process=process).spec(network)
        torch.manual_seed(SEED)
        module = build_trainable(spec, validate=False)
        setups[process] = (module, make_objective(spec, validate=False),
                           build_optimizer(module, OptimSection(), torch.device("cpu")))
    seconds: dict[str, list[float]] = {process: [] for process in args.processes}
    for repeat in range(args.warmup + args.repeats):
        slot = MicroBatchSlot(seed=SEED, step=repeat, rank=0, world_size=1, micro=0, micro_batches=1)
        for process, (module, objective, optimizer) in setups.items():
            start = time.perf_counter()
            (objective.loss_sum(module, batch, slot) / batch.numel()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if repeat >= args.warmup:
                seconds[process].append(time.perf_counter() - start)
    base = statistics.median(seconds[BASELINE])
    return [{"process": process, "batch": list(batch.shape), "vocab_size": network.vocab_size,
             "median_step_s": statistics.median(times), "time_vs_absorbing": statistics.median(times) / base,
             "repeats": len(times), "threads": torch.get_num_threads()} for process, times in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an `unmask prep` output directory")
    parser.add_argument("--part", choices=("quality", "timing"), default="quality")
    parser.add_argument("--processes", nargs="+", choices=PROCESSES, default=list(PROCESSES))
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16, help="time samples per block of the val bound")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per process (timing)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per process first (timing)")
    parser.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    if args.part == "timing" and BASELINE not in args.processes:
        parser.error(f"--part timing reports ratios to {BASELINE}: include it in --processes")
    if args.part == "timing":
        results = timing(args)
        for result in results:
            print(json.dumps(result), flush=True)
        print(json.dumps({"summary": results}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = []
        for process in args.processes:
            results.append(quality(args, process, root))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": results}, indent=2))


if __name__ == "__main__":
    main()

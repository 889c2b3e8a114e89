"""Document masking (``model.document_mask``) on and off, on the same data and budget.

Trains the `tiny` recipe through the real pipeline (`unmask train`, one process, CPU) twice
per objective, every run with the same config (steps, batch, learning rate, seed) but
``model.document_mask``, and scores each EMA export on the held-out split with `unmask eval
--datasets val` (the full bound, K time samples per sequence, its standard error; the AR
model's exact NLL). Both bounds bound -log p(x) of the same packed windows: the masked
network reads its documents from z_t alone (model.documents), so neither is told more.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \\
        --out /tmp/ts --seq-len 128 --vocab-size 1024 --val-fraction 0.05
    .venv/bin/python bench/document_mask.py --data /tmp/ts --steps 200

Prints one JSON object per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline_runs import run_unmask, tiny_recipe

SEED = 0
OBJECTIVES = {"mdlm": ("tiny", {}), "bd3-4": ("tiny", {"block_size": 4}), "ar": ("tiny-ar", {})}


def _unmask(args: list[str]) -> str:
    return run_unmask(args, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))


def train(args: argparse.Namespace, objective: str, masked: bool, root: Path) -> Path:
    """Train one model; its run directory."""
    base, model = OBJECTIVES[objective]
    name = f"{objective}-{'documents' if masked else 'window'}"
    config, run_dir = root / f"{name}.yaml", root / name
    if args.reuse and (run_dir / "checkpoints").is_dir():
        return run_dir
    recipe = tiny_recipe(args.steps, args.global_batch, SEED, base=base, model={**model, "document_mask": masked})
    config.write_text(yaml.safe_dump(recipe))
    _unmask(["train", "--config", str(config), "--data", args.data, "--run-dir", str(run_dir)])
    return run_dir


def score(args: argparse.Namespace, objective: str, masked: bool, run_dir: Path) -> dict:
    """The val bound of one trained model."""
    if not (args.reuse and (run_dir / "report" / "results.json").is_file()):
        _unmask(["eval", str(run_dir), "--datasets", "val", "--shards", args.data, "--samples", str(args.samples),
                 "--seed", str(SEED), "--num-samples", "0",
                 "--mlflow-uri", f"sqlite:///{run_dir.parent / 'mlflow.db'}"])
    val = json.loads((run_dir / "report" / "results.json").read_text())["datasets"]["val"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["train/step_time"] for r in records if "train/step_time" in r][1:]
    return {"objective": objective, "document_mask": masked, "steps": args.steps,
            "val_nelbo_per_token": val["nelbo_per_token"], "standard_error": val["standard_error"],
            "perplexity_bound": val["perplexity_bound"],
            "final_train_loss": next(r["train/loss"] for r in reversed(records) if "train/loss" in r),
            "median_step_time_s": statistics.median(step_times) if step_times else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an `unmask prep` output directory")
    parser.add_argument("--objectives", nargs="*", default=["mdlm"], choices=sorted(OBJECTIVES))
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of every run")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16, help="time samples per sequence of the val bound")
    parser.add_argument("--modes", nargs="*", default=["window", "documents"], choices=["window", "documents"],
                        help="attention over the whole window, per document, or both (two calls may share --out)")
    parser.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --out: read the runs already trained and scored there instead of redoing them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = []
        for objective in args.objectives:
            for masked in [mode == "documents" for mode in args.modes]:
                results.append(score(args, objective, masked, train(args, objective, masked, root)))
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": results}, indent=2))


if __name__ == "__main__":
    main()

"""MDLM against block diffusion (BD3-LM) and an autoregressive model on the same data and budget.

Trains the `tiny` preset through the real pipeline (`unmask train`, one process, CPU) once
per block size, every run with the same config (steps, batch, learning rate, seed) but
``model.block_size`` (none: MDLM), and the `tiny-ar` baseline with the same config (the
paper's L' = 1 end of the table). Each EMA export is scored on the held-out split with
`unmask eval --datasets val` (the full bound, K time samples per block, its standard error;
the AR model's exact NLL) and draws samples with the first-hitting sampler (a block model
through its KV cache): their mean unigram entropy, and their generative perplexity under the
AR model trained here (``--reference`` gives another). The AR model's own samples (left to
right, temperature 1), scored by itself, are the papers' "AR" row, which flatters it. The
paper's ordering, at 524B tokens: AR < BD3 L' = 4 < 16 < MDLM.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \\
        --out /tmp/ts --seq-len 128 --vocab-size 1024 --val-fraction 0.05
    .venv/bin/python bench/block_comparison.py --data /tmp/ts --steps 200

Prints one JSON object per model and a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline_runs import run_unmask, tiny_recipe  # noqa: E402

SEED = 0
BOOTSTRAP_DRAWS = 2000  # resamples of the samples for the generative perplexity's interval


AR = "ar"  # the autoregressive run's name, in place of a block size


def _config(args: argparse.Namespace, block_size: int | None | str) -> dict:
    """The `tiny` recipe; only the block size (or the objective: `tiny-ar`) differs."""
    if block_size == AR:
        return tiny_recipe(args.steps, args.global_batch, SEED, base="tiny-ar")
    return tiny_recipe(args.steps, args.global_batch, SEED, model={"block_size": block_size})


def _unmask(args: list[str]) -> str:
    return run_unmask(args, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))


def _name(block_size: int | None | str) -> str:
    return "mdlm" if block_size is None else AR if block_size == AR else f"bd3-{block_size}"


def train(args: argparse.Namespace, block_size: int | None | str, root: Path) -> Path:
    """Train one model; its run directory."""
    name = _name(block_size)
    config, run_dir = root / f"{name}.yaml", root / name
    if args.reuse and (run_dir / "checkpoints").is_dir():
        return run_dir
    config.write_text(yaml.safe_dump(_config(args, block_size)))
    _unmask(["train", "--config", str(config), "--data", args.data, "--run-dir", str(run_dir)])
    return run_dir


def score(args: argparse.Namespace, block_size: int | None | str, run_dir: Path, reference: Path) -> dict:
    """The val bound of one trained model, and its samples' entropy and generative perplexity."""
    sampler = [] if block_size == AR else ["--sampler", "first-hitting"]  # an AR model samples left to right
    if not (args.reuse and (run_dir / "report" / "results.json").is_file()):
        _unmask(["eval", str(run_dir), "--datasets", "val", "--shards", args.data, "--samples", str(args.samples),
                 "--seed", str(SEED), "--num-samples", str(args.num_samples), *sampler, "--reference",
                 str(reference), "--mlflow-uri", f"sqlite:///{run_dir.parent / 'mlflow.db'}"])
    results = json.loads((run_dir / "report" / "results.json").read_text())
    val, sampling = results["datasets"]["val"], results["sampling"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["train/step_time"] for r in records if "train/step_time" in r][1:]
    return {"model": _name(block_size), "block_size": block_size, "steps": args.steps,
            "val_nelbo_per_token": val["nelbo_per_token"], "standard_error": val["standard_error"],
            "perplexity_bound": val["perplexity_bound"], "perplexity_interval_95": val["perplexity_interval"],
            "final_train_loss": next(r["train/loss"] for r in reversed(records) if "train/loss" in r),
            "median_step_time_s": statistics.median(step_times) if step_times else None,
            "sample_unigram_entropy": sampling["mean_unigram_entropy"],
            "generative_perplexity": sampling["generative_perplexity"]["perplexity"],
            "generative_perplexity_interval_95": bootstrap_interval(results["samples"]),
            "scored_tokens": sampling["generative_perplexity"]["tokens"]}


def bootstrap_interval(samples: list[dict]) -> list[float]:
    """A 95% percentile-bootstrap interval of the pooled generative perplexity, exp(sum NLL /
    sum tokens), resampling whole samples (their lengths differ: a sample ends at its EOS)."""
    rng = random.Random(SEED)
    scored = [(s["reference_nll"], s["reference_tokens"]) for s in samples if s.get("reference_tokens")]
    draws = sorted(math.exp(sum(n for n, _ in pick) / sum(t for _, t in pick))
                   for pick in (rng.choices(scored, k=len(scored)) for _ in range(BOOTSTRAP_DRAWS)))
    return [draws[int(0.025 * BOOTSTRAP_DRAWS)], draws[int(0.975 * BOOTSTRAP_DRAWS) - 1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an `unmask prep` output directory")
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[4, 16], help="BD3's L' (MDLM always runs)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16, help="time samples per block of the val bound")
    parser.add_argument("--num-samples", type=int, default=32, help="samples drawn from each model")
    parser.add_argument("--reference", type=Path,
                        help="the autoregressive model scoring the samples (default: the AR model trained here)")
    parser.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --out: read the runs already trained and scored there instead of redoing them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = {block_size: train(args, block_size, root) for block_size in [AR, None, *args.block_sizes]}
        reference = args.reference or runs[AR] / "export"  # the export: the AR run's own report goes beside it
        if args.reference is None:
            _unmask(["export", str(runs[AR])])  # --reference reads an export; eval exports only the run it scores
        results = []
        for block_size, run_dir in runs.items():
            results.append(score(args, block_size, run_dir, reference))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": results}, indent=2))


if __name__ == "__main__":
    main()

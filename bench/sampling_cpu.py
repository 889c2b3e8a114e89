"""Sampling throughput on CPU per sampler: sequences per second and network calls, at a few
budgets, against the ancestral sampler measured in the same run.

For each budget (``--steps``: the plan's budget of network calls per sequence) it draws one
batch from all-mask with ``AbsorbingDiffusion.sample`` per variant:
  ancestral-no-cache  the network at every step (the reference of the cache; same samples)
  ancestral           calls only for rows where the step reveals a token (MDLM's caching)
  first-hitting       exact at budget >= seq_len: one call per token; below, k tokens per call
  confidence          one call per step, the most confident positions revealed
  remdm               ReMDM (cap): at most one call per step, revealed tokens may be remasked
The variants run interleaved, repeated, and the median is reported, because this machine is
noisy; the ratio to ``ancestral`` measured in the same run is the figure to compare. The
network is an untrained time-free preset: what a call costs does not depend on the weights.
Which steps call the network does, for confidence and first-hitting not at all, for ancestral
and remdm only through the schedule's coins. ``--static-shape`` passes every row through
every call (a fixed input shape, what CUDA graphs need).

    python bench/sampling_cpu.py [--preset tiny] [--steps 64 256 1024] [--batch 8] [--seq-len 128]

Prints one JSON object per (steps, variant) line after a line describing the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace

import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan, SamplingStats
from model.schedules import make_schedule
from model.transformer import Transformer, parameter_counts, preset

VOCAB_SIZE = 4096   # a small tokenizer's vocabulary, as bench/model_cpu.py's tiny shape
BASELINE = "ancestral"
VARIANTS = {"ancestral-no-cache": SamplingPlan(cache=False), "ancestral": SamplingPlan(),
            "first-hitting": SamplingPlan(sampler="first-hitting"), "confidence": SamplingPlan(sampler="confidence"),
            "remdm": SamplingPlan(sampler="remdm")}


def _draw(diffusion: AbsorbingDiffusion, network: Transformer, plan: SamplingPlan, batch: int,
          seq_len: int) -> tuple[float, SamplingStats]:
    """Seconds for one batch, and what it cost (the plan's seed: the same samples every draw)."""
    start = time.perf_counter()
    with torch.inference_mode():
        _, stats = diffusion.sample(network, plan, num_samples=batch, seq_len=seq_len)
    return time.perf_counter() - start, stats


def bench_steps(diffusion: AbsorbingDiffusion, network: Transformer, plans: dict[str, SamplingPlan], batch: int,
                seq_len: int, repeats: int) -> list[dict]:
    """One row per variant at one budget, with its speed relative to ``BASELINE``."""
    warm = next(iter(plans.values()))
    _draw(diffusion, network, replace(warm, steps=min(warm.steps, 8)), batch, seq_len)  # allocator, thread pools
    times: dict[str, list[float]] = {name: [] for name in plans}
    stats: dict[str, SamplingStats] = {}
    for _ in range(repeats):
        for name, plan in plans.items():
            seconds, stats[name] = _draw(diffusion, network, plan, batch, seq_len)
            times[name].append(seconds)
    reference = statistics.median(times[BASELINE])
    return [{"steps": plans[name].steps, "variant": name, "batch": batch, "seq_len": seq_len,
             "static_shape": plans[name].static_shape,
             "network_calls": stats[name].network_calls, "rows_evaluated": stats[name].rows_evaluated,
             "calls_per_sequence": round(sum(stats[name].row_calls) / batch, 2),
             "median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
             "sequences_per_s": round(batch / statistics.median(values), 3),
             "speedup_vs_ancestral": round(reference / statistics.median(values), 2)}
            for name, values in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--static-shape", action="store_true", help="every row through every call")
    args = parser.parse_args()
    if BASELINE not in args.variants:
        parser.error(f"--variants must include the baseline {BASELINE}")
    torch.manual_seed(0)
    config = preset(args.preset, VOCAB_SIZE, max_seq_len=max(args.seq_len, 256))
    network = Transformer(config).eval()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB_SIZE, validate=False)
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "python": platform.python_version(), "preset": args.preset, "vocab_size": VOCAB_SIZE,
                      "params": parameter_counts(config).total}))
    for steps in args.steps:
        plans = {name: replace(VARIANTS[name], steps=steps, static_shape=args.static_shape) for name in args.variants}
        for row in bench_steps(diffusion, network, plans, args.batch, args.seq_len, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Sampling throughput on CPU: sequences per second of the ancestral sampler, with and without
caching, at a few step counts.

For each step count it draws one batch from all-mask with ``MaskedDiffusion.sample`` twice:
  cache     the network is called only for rows where the step unmasks something (MDLM's
            caching for a time-free network: at most seq_len rows evaluated per sequence,
            however many steps)
  no_cache  the network is called at every step (the reference; the same samples for a seed)
The variants run interleaved, repeated, and the median is reported, because this machine is
noisy; the cache / no-cache ratio measured in the same run is the figure to compare. The
network is an untrained time-free preset: what a step costs does not depend on the weights,
and which steps unmask something depends only on the schedule.

    python bench/sampling_cpu.py [--preset tiny] [--steps 128 1000] [--batch 8] [--seq-len 128]

Prints one JSON object per (steps, variant) line after a line describing the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from model.diffusion import MaskedDiffusion
from model.sampling import SamplingStats
from model.schedules import make_schedule
from model.transformer import Transformer, parameter_counts, preset

VOCAB_SIZE = 4096   # a small tokenizer's vocabulary, as bench/model_cpu.py's tiny shape
VARIANTS = {"cache": True, "no_cache": False}


def _draw(diffusion: MaskedDiffusion, network: Transformer, batch: int, seq_len: int, steps: int,
          cache: bool) -> tuple[float, SamplingStats]:
    """Seconds for one batch, and the network calls it made (the same seed for every draw)."""
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        _, stats = diffusion.sample(network, batch, seq_len, steps, generator, cache=cache, return_stats=True)
    return time.perf_counter() - start, stats


def bench_steps(diffusion: MaskedDiffusion, network: Transformer, batch: int, seq_len: int, steps: int,
                repeats: int) -> list[dict]:
    _draw(diffusion, network, batch, seq_len, min(steps, 8), cache=True)  # warm-up: allocator, thread pools
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    stats: dict[str, SamplingStats] = {}
    for _ in range(repeats):
        for name, cache in VARIANTS.items():
            seconds, stats[name] = _draw(diffusion, network, batch, seq_len, steps, cache)
            times[name].append(seconds)
    reference = statistics.median(times["no_cache"])
    return [{"steps": steps, "variant": name, "batch": batch, "seq_len": seq_len,
             "network_calls": stats[name].network_calls, "rows_evaluated": stats[name].rows_evaluated,
             "median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
             "sequences_per_s": round(batch / statistics.median(values), 3),
             "speedup_vs_no_cache": round(reference / statistics.median(values), 2)}
            for name, values in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, nargs="+", default=[128, 1000])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = preset(args.preset, VOCAB_SIZE, max_seq_len=max(args.seq_len, 256))
    network = Transformer(config).eval()
    diffusion = MaskedDiffusion(make_schedule("linear"), VOCAB_SIZE)
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "python": platform.python_version(), "preset": args.preset, "vocab_size": VOCAB_SIZE,
                      "params": parameter_counts(config).total}))
    for steps in args.steps:
        for row in bench_steps(diffusion, network, args.batch, args.seq_len, steps, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

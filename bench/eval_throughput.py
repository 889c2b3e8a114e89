"""Evaluation throughput: tokens scored per second per time sample (``estimate_bound``).

For each preset, times ``estimate_bound`` with K time samples over N blocks of random tokens
(the cost does not depend on the token values) and, as the baseline measured in the same
run, a plain no-grad forward of the network over the same blocks with logits at every
position. On a GPU both run under bf16 autocast, as ``unmask eval`` does; with ``--tuned``
also as it runs with its GPU defaults: compiled, with the fastest attention kernel
(``evaluation.inference.inference_mode``), ``--batch-size`` left to the device when not given.
Prints one JSON object per preset. Example:

    .venv/bin/python bench/eval_throughput.py --presets tiny small --seq-len 256
    .venv/bin/python bench/eval_throughput.py --presets medium --seq-len 1024 --device cuda --blocks 64 --tuned
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluation.bounds.estimator import Blocks, estimate_bound  # noqa: E402
from evaluation.bounds.scoring import default_batch_size  # noqa: E402
from evaluation.inference import inference_mode  # noqa: E402
from model.absorbing import AbsorbingDiffusion  # noqa: E402
from model.schedules import make_schedule  # noqa: E402
from model.transformer import Transformer, preset  # noqa: E402

GPT2_VOCAB = 50257
BLOCKS = {"tiny": 32, "small": 4, "medium": 2}
UNTUNED_BATCH = 8  # blocks per call of the runs before --tuned existed


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks time it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], repeats: int, device: torch.device = torch.device("cpu")) -> float:
    fn()  # warm-up: allocator and kernels
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def inference_precision(device: torch.device):
    """bf16 autocast on GPU, as ``unmask eval`` runs; float32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def measure(name: str, seq_len: int, samples: int, batch_size: int | None, repeats: int, *,
            vocab_size: int = GPT2_VOCAB, blocks: int | None = None, device: str = "cpu", tuned: bool = False) -> dict:
    """One preset's figures; ``blocks`` defaults to ``BLOCKS[name]``; ``tuned``: as ``unmask
    eval`` runs (module docstring), ``batch_size`` None then sized to the device."""
    device_ = torch.device(device)
    torch.manual_seed(0)
    network = Transformer(preset(name, vocab_size, max_seq_len=seq_len)).to(device_).eval()  # an export's
    diffusion = AbsorbingDiffusion(make_schedule("linear"), vocab_size, validate=False)
    count = blocks or BLOCKS[name]
    tokens = torch.randint(0, vocab_size, (count, seq_len))
    scored_blocks = Blocks(tokens, torch.ones_like(tokens, dtype=torch.bool))
    on_device = tokens.to(device_)
    batch_size = batch_size or default_batch_size(network.config, seq_len, device_)
    if tuned and device_.type == "cuda":  # unmask eval compiles on GPU only (evaluation.bounds.scoring.should_compile)
        network.compile_parts()
    running = (lambda: inference_mode(network, device_)) if tuned else (lambda: inference_precision(device_))

    def forward() -> None:
        with torch.no_grad(), running():
            for i in range(0, count, batch_size):
                network(on_device[i:i + batch_size])

    def estimate() -> None:
        with torch.no_grad(), running():
            estimate_bound(diffusion, network, scored_blocks, samples_per_block=samples, batch_size=batch_size,
                           device=device_)

    scored = count * seq_len
    forward_s, estimate_s = _timed(forward, repeats, device_), _timed(estimate, repeats, device_)
    return {"preset": name, "seq_len": seq_len, "vocab": vocab_size, "blocks": count, "samples_per_block": samples,
            "device": device_.type, "tuned": tuned, "batch_size": batch_size,
            "forward_tokens_per_s": scored / forward_s,
            "estimate_tokens_per_s_per_sample": scored * samples / estimate_s,
            "estimate_time_vs_forward": estimate_s / (samples * forward_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2, help="time samples per block K")
    parser.add_argument("--batch-size", type=int, help="blocks per call (default: 8, or sized to the device with "
                                                       "--tuned)")
    parser.add_argument("--tuned", action="store_true", help="as `unmask eval` runs: compiled, fastest attention")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", type=int, help=f"blocks to score (default per preset: {BLOCKS})")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    args = parser.parse_args()
    for name in args.presets:
        batch_size = args.batch_size or (None if args.tuned else UNTUNED_BATCH)
        print(json.dumps(measure(name, args.seq_len, args.samples, batch_size, args.repeats,
                                 blocks=args.blocks, device=args.device, tuned=args.tuned)), flush=True)


if __name__ == "__main__":
    main()

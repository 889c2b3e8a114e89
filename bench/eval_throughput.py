"""Evaluation throughput: tokens scored per second per time sample (``estimate_bound``).

For each preset, times ``estimate_bound`` with K time samples over N blocks of random tokens
(the cost does not depend on the token values) and, as the baseline measured in the same
run, a plain no-grad forward of the network over the same blocks with logits at every
position. Prints one JSON object per preset. Example:

    .venv/bin/python bench/eval_throughput.py --presets tiny small --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluation.estimator import Blocks, estimate_bound  # noqa: E402
from model.diffusion import MaskedDiffusion  # noqa: E402
from model.schedules import make_schedule  # noqa: E402
from model.transformer import Transformer, preset  # noqa: E402

GPT2_VOCAB = 50257
BLOCKS = {"tiny": 32, "small": 4, "medium": 2}


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocator and kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, seq_len: int, samples: int, batch_size: int, repeats: int) -> dict:
    torch.manual_seed(0)
    network = Transformer(preset(name, GPT2_VOCAB, max_seq_len=seq_len)).eval()
    diffusion = MaskedDiffusion(make_schedule("linear"), GPT2_VOCAB, validate=False)
    count = BLOCKS[name]
    tokens = torch.randint(0, GPT2_VOCAB, (count, seq_len))
    blocks = Blocks(tokens, torch.ones_like(tokens, dtype=torch.bool))

    def forward() -> None:
        with torch.no_grad():
            for i in range(0, count, batch_size):
                network(tokens[i:i + batch_size])

    def estimate() -> None:
        with torch.no_grad():
            estimate_bound(diffusion, network, blocks, samples_per_block=samples, batch_size=batch_size)

    scored = count * seq_len
    forward_s, estimate_s = _timed(forward, repeats), _timed(estimate, repeats)
    return {"preset": name, "seq_len": seq_len, "vocab": GPT2_VOCAB, "blocks": count, "samples_per_block": samples,
            "forward_tokens_per_s": scored / forward_s,
            "estimate_tokens_per_s_per_sample": scored * samples / estimate_s,
            "estimate_time_vs_forward": estimate_s / (samples * forward_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2, help="time samples per block K")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in args.presets:
        print(json.dumps(measure(name, args.seq_len, args.samples, args.batch_size, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

"""Autoregressive sampling on CPU with the KV cache against without it: sequences per second,
the same network, the same samples.

``evaluation.generation.generate.autoregressive_sample`` reads one new row per call against the
keys and values of the tokens before it; the reference re-reads the whole context at every call
(how it sampled before the cache, and how a model with ``model.document_mask`` still samples).
Both draw the same tokens (asserted). Runs interleaved, repeated, median reported: the ratio
from one run is the figure to compare. An untrained causal preset: a call's cost does not
depend on the weights.

    python bench/autoregressive_cpu.py [--preset tiny] [--seq-len 256] [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from evaluation.generation.generate import autoregressive_sample
from model.sampling import SamplingPlan, inverse_cdf, row_uniforms, sample_generators, token_probs
from model.transformer import Transformer, preset

VOCAB_SIZE = 4096   # as bench/sampling_cpu.py


def without_cache(network: Transformer, batch: int, seq_len: int, plan: SamplingPlan) -> torch.Tensor:
    """The whole context through the network at every call, the last position's logits drawn."""
    generators = sample_generators(plan.seed, range(batch))
    tokens = torch.full((batch, 1), VOCAB_SIZE, dtype=torch.long)   # [B, 1 + generated]: the start token first
    every_row = torch.ones(batch, dtype=torch.bool)
    for _ in range(seq_len):
        last = torch.zeros(tokens.shape, dtype=torch.bool)
        last[:, -1] = True
        probs = token_probs(network(tokens, None, output_mask=last), plan)
        drawn = inverse_cdf(probs, row_uniforms((), generators, every_row, torch.device("cpu")))   # [B]
        tokens = torch.cat([tokens, drawn[:, None]], dim=1)
    return tokens[:, 1:]


def with_cache(network: Transformer, batch: int, seq_len: int, plan: SamplingPlan) -> torch.Tensor:
    empty = torch.empty((batch, 0), dtype=torch.long)
    return autoregressive_sample(network, VOCAB_SIZE, empty, seq_len, plan, sample_generators(plan.seed, range(batch)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    network = Transformer(preset(args.preset, VOCAB_SIZE, max_seq_len=args.seq_len, causal=True)).eval()
    plan = SamplingPlan(seed=0)
    print(json.dumps({"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch}))
    seconds = {"without-cache": [], "kv-cache": []}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, draw in (("without-cache", without_cache), ("kv-cache", with_cache)):
                start = time.perf_counter()
                tokens = draw(network, args.batch, args.seq_len, plan)
                seconds[name].append(time.perf_counter() - start)
                if name == "without-cache":
                    reference = tokens
                else:
                    assert torch.equal(tokens, reference), "the cache changed the samples"
    for name, times in seconds.items():
        median = statistics.median(times)
        print(json.dumps({"variant": name, "seconds": round(median, 3), "sequences_per_s": args.batch / median,
                          "speedup": statistics.median(seconds["without-cache"]) / median}))


if __name__ == "__main__":
    main()

"""Block diffusion (BD3-LM) on CPU: its training step against MDLM's at equal tokens, and its
KV-cache sampling against MDLM's semi-autoregressive sampling at the same block size.

Training: forward + backward of the training objective (``pipeline.training.objective``) on the same
batch of B sequences of L tokens, MDLM (``model.block_size`` null) and BD3 at each
``--block-sizes`` L' (one forward over [z ; x], 2L rows, under the dense block mask: SDPA,
what a CPU trains with). The ratio BD3 / MDLM of the median step time is the figure.

Sampling: ``--samples`` sequences of ``--sample-len`` tokens from all-mask with the exact
first-hitting sampler (one network call per generated token, in both), MDLM with
``plan.block_len = L'`` (each block's calls see the window of text before it, recomputed) and
BD3 with its KV cache (a call sees the block's L' rows; each finished block runs once more,
clean, into the cache). Tokens per second of each and their ratio. Untrained networks: the
cost of a call does not depend on the weights, and first-hitting makes the same number of
calls whatever they predict.

The variants run interleaved, ``--repeats`` times, median reported (this machine is noisy).

    python bench/block_diffusion_cpu.py [--preset tiny] [--seq-len 256] [--block-sizes 4 16]

Prints one JSON object per line after a line describing the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.sampling import SamplingPlan
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import Transformer, preset
from pipeline.training.objective import MicroBatchSlot, make_objective

VOCAB_SIZE = 4096   # a small tokenizer's vocabulary, as bench/model_cpu.py's tiny shape


def _network(name: str, seq_len: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset(name, VOCAB_SIZE, max_seq_len=seq_len))


def _step_seconds(network: Transformer, block_size: int | None, x0: torch.Tensor, step: int) -> float:
    objective = make_objective(ModelSpec(network=network.config, block_size=block_size), validate=False)
    slot = MicroBatchSlot(seed=0, step=step, rank=0, world_size=1, micro=0, micro_batches=1)
    start = time.perf_counter()
    loss = objective.loss_sum(network, x0, slot) / x0.numel()
    loss.backward()
    network.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench_training(args: argparse.Namespace) -> list[dict]:
    network = _network(args.preset, args.seq_len).train()
    x0 = torch.randint(0, VOCAB_SIZE, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    variants = [None, *args.block_sizes]
    times: dict[int | None, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up: allocator, kernels
        _step_seconds(network, v, x0, 0)
    for repeat in range(args.repeats):
        for v in variants:
            times[v].append(_step_seconds(network, v, x0, repeat + 1))
    mdlm = statistics.median(times[None])
    rows = []
    for v in variants:
        median = statistics.median(times[v])
        rows.append({"bench": "train_step", "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len,
                     "model": "mdlm" if v is None else f"bd3 L'={v}", "block_size": v, "step_s": round(median, 4),
                     "tokens_per_s": round(args.batch * args.seq_len / median, 1),
                     "ratio_to_mdlm": round(median / mdlm, 3)})
    return rows


def _sample_seconds(network: Transformer, block_size: int, bd3: bool, args: argparse.Namespace) -> tuple[float, int]:
    schedule = make_schedule("linear")
    if bd3:
        process, plan = BlockDiffusion(schedule, VOCAB_SIZE, block_size), SamplingPlan(sampler="first-hitting")
    else:
        process = AbsorbingDiffusion(schedule, VOCAB_SIZE)
        plan = SamplingPlan(sampler="first-hitting", block_len=block_size)
    start = time.perf_counter()
    with torch.inference_mode():
        _, stats = process.sample(network, plan, num_samples=args.samples, seq_len=args.sample_len,
                                  window=args.seq_len)
    return time.perf_counter() - start, stats.network_calls


def bench_sampling(args: argparse.Namespace) -> list[dict]:
    network = _network(args.preset, args.seq_len).eval()
    rows = []
    for block_size in args.block_sizes:
        times: dict[bool, list[float]] = {False: [], True: []}
        calls: dict[bool, int] = {}
        for repeat in range(args.repeats):
            for bd3 in (False, True):
                seconds, calls[bd3] = _sample_seconds(network, block_size, bd3, args)
                times[bd3].append(seconds)
        tokens = args.samples * args.sample_len
        semi_ar, cached = statistics.median(times[False]), statistics.median(times[True])
        for bd3, median in ((False, semi_ar), (True, cached)):
            rows.append({"bench": "sampling", "preset": args.preset, "window": args.seq_len,
                         "sample_len": args.sample_len, "samples": args.samples, "block_size": block_size,
                         "model": f"bd3 KV cache L'={block_size}" if bd3 else f"mdlm --block-len {block_size}",
                         "network_calls": calls[bd3], "seconds": round(median, 3),
                         "tokens_per_s": round(tokens / median, 1),
                         "speedup_over_semi_ar": round(semi_ar / median, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256, help="training length L, and the sampling window")
    parser.add_argument("--batch", type=int, default=8, help="sequences per training step")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--sample-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", choices=["train", "sampling"], help="leave one part out")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "torch_threads": torch.get_num_threads(), "torch": torch.__version__}))
    rows = ([] if args.skip == "train" else bench_training(args)) + \
        ([] if args.skip == "sampling" else bench_sampling(args))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()

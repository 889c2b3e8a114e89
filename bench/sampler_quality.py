"""Sample quality against network calls, per sampler: generative perplexity under a reference
autoregressive model and mean unigram entropy, for every sampler the diffusion export's process
takes, at budgets of 16 to 1024 network calls (``evaluation.generation.sampler_sweep``, what ``unmask eval
--sample-sweep`` puts in the report).

Quality figures do not depend on the machine's load: record them in BENCHMARKS.md. Each
(sampler, budget) row draws ``--num`` samples of the network's ``max_seq_len`` tokens with the
seeds given (the rows of several seeds show the noise of the estimate). As a baseline in the same
run, the reference's own samples (left to right, temperature 1: one call per token) are scored
by the reference itself, the usual "AR" row of the papers, which flatters it.

    python bench/sampler_quality.py --diffusion runs/tiny --reference runs/tiny-ar [--num 16] [--seeds 0 1]

Prints one JSON object per row after a line describing the setup, then the table in Markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from evaluation.generation.generate import generate
from evaluation.generation.sample_quality import load_reference, score_samples
from evaluation.generation.sampler_sweep import SWEEP_BUDGETS, sampler_sweep, sweep_samplers
from evaluation.results import SweepRow
from model.sampling import SamplingPlan
from pipeline.interchange.export import load_export, resolve_export


def _reference_row(reference_path: Path, plan: SamplingPlan, num: int, batch_size: int, reference) -> SweepRow:
    """The reference's own samples, scored by itself."""
    exported = load_export(resolve_export(reference_path))
    samples = generate(exported, replace(plan, sampler="ancestral", steps=1, options=None), num=num,
                       batch_size=batch_size)
    quality = score_samples(samples, exported.tokenizer, reference)
    return SweepRow(sampler="autoregressive (the reference)", budget=len(samples[0].tokens),
                    network_calls=sum(s.network_calls for s in samples) / len(samples),
                    mean_unigram_entropy=quality.mean_unigram_entropy,
                    generative_perplexity=quality.generative_perplexity.perplexity)


def _table(rows_by_seed: dict[int, list[SweepRow]]) -> str:
    """Markdown: one line per (sampler, budget), the mean over seeds and, with several, their range."""
    seeds = list(rows_by_seed)
    lines = ["| sampler | budget | network calls / sample | generative perplexity | mean unigram entropy (nats) |",
             "|---|---|---|---|---|"]
    for position, row in enumerate(rows_by_seed[seeds[0]]):
        same = [rows_by_seed[seed][position] for seed in seeds]
        perplexity = [r.generative_perplexity for r in same]
        spread = f" ({min(perplexity):.1f}-{max(perplexity):.1f})" if len(seeds) > 1 else ""
        lines.append(f"| {row.sampler} | {row.budget} | {statistics.mean(r.network_calls for r in same):.1f} | "
                     f"{statistics.mean(perplexity):.1f}{spread} | "
                     f"{statistics.mean(r.mean_unigram_entropy for r in same):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--diffusion", type=Path, required=True, help="the diffusion run or export")
    parser.add_argument("--reference", type=Path, required=True, help="the autoregressive run or export")
    parser.add_argument("--num", type=int, default=16, help="samples per row and seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=list(SWEEP_BUDGETS))
    parser.add_argument("--samplers", nargs="+", help="default: every sampler the process takes")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    exported = load_export(resolve_export(args.diffusion))
    reference = load_reference(args.reference)
    print(json.dumps({"diffusion": str(args.diffusion), "reference": str(args.reference), "num": args.num,
                      "seeds": args.seeds, "seq_len": exported.network.config.max_seq_len,
                      "samplers": list(args.samplers or sweep_samplers(exported)), "top_p": args.top_p,
                      "temperature": args.temperature, "torch": torch.__version__,
                      "machine": platform.processor() or platform.machine()}), flush=True)
    rows_by_seed: dict[int, list[SweepRow]] = {}
    for seed in args.seeds:
        start = time.perf_counter()
        base = SamplingPlan(top_p=args.top_p, temperature=args.temperature, seed=seed)
        rows = sampler_sweep(exported, base, reference, num=args.num, budgets=args.budgets, samplers=args.samplers,
                             batch_size=args.batch_size)
        rows.append(_reference_row(args.reference, base, args.num, args.batch_size, reference))
        for row in rows:
            print(json.dumps({"seed": seed, **row.to_json()}), flush=True)
        print(json.dumps({"seed": seed, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        rows_by_seed[seed] = rows
    print(_table(rows_by_seed))


if __name__ == "__main__":
    main()

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

``--fast`` measures fast generation instead (docs/fast-generation.md): for each plan of
``FAST_PLANS`` (exact first-hitting, threshold decoding at several thresholds, semi-autoregressive
blocks with the prefix cache at several refresh intervals, whole-sequence blocks with the dual
cache, and their combinations) the generative perplexity with its 95% interval (delta method over
the samples), the mean unigram entropy, the network calls per sample and the wall-clock seconds
per sample; then, for each plan of ``DRIFT_PLANS`` (a cache at each refresh interval), the mean
KL(exact || cached) of the per-token distributions the cache moves, over every call and over the
calls that read a stale cache (``--drift-plans`` picks them by name). With ``--prompt``,
``GUIDED_PLANS`` continue it at guidance weights 0, 0.5 and 1. Last, the reference's own samples
as ``unmask sample`` draws them (one call per token against its KV cache), in the same run.
Wall-clock depends on the machine's load: one thread by default (``--threads``), and only ratios
within one run compare.

    python bench/sampler_quality.py --diffusion models/mdlm --reference models/ar --fast --num 32 \
        --batch-size 32 --prompt "ROMEO:"
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from evaluation.generation.generate import Sample, generate
from evaluation.generation.sample_quality import load_reference, score_samples
from evaluation.generation.sampler_sweep import SWEEP_BUDGETS, sampler_sweep, sweep_samplers
from evaluation.results import SweepRow
from model.sampling import SamplingPlan, ThresholdOptions
from model.sampling.window import WindowNetwork
from pipeline.interchange.export import Exported, load_export, resolve_export

BLOCK = 16
REFRESH_INTERVALS = (1, 2, 4, 8, 16)


def _threshold(value: float, **plan) -> SamplingPlan:
    return SamplingPlan(sampler="threshold", options=ThresholdOptions(threshold=value), **plan)


THRESHOLDS = (0.9, 0.7, 0.5, 0.3, 0.2, 0.1)
# name -> plan: one token per call (exact), the budgeted samplers at several budgets, fewer calls by
# threshold decoding, then blocks with the prefix cache at every refresh interval of the KL table.
FAST_PLANS = {
    "first-hitting (exact, 1 token/call)": SamplingPlan(sampler="first-hitting"),
    **{f"ancestral, {steps} steps": SamplingPlan(sampler="ancestral", steps=steps) for steps in (1024, 128, 32, 16)},
    **{f"confidence, {steps} steps": SamplingPlan(sampler="confidence", steps=steps) for steps in (128, 32, 16)},
    "remdm (cap), 256 steps": SamplingPlan(sampler="remdm", steps=256),
    **{f"threshold {value}": _threshold(value) for value in THRESHOLDS},
    f"first-hitting, blocks of {BLOCK}": SamplingPlan(sampler="first-hitting", block_len=BLOCK),
    **{f"first-hitting, blocks of {BLOCK}, prefix cache {n}": SamplingPlan(sampler="first-hitting", block_len=BLOCK,
                                                                          prefix_cache=n) for n in REFRESH_INTERVALS},
    f"threshold 0.7, blocks of {BLOCK}": _threshold(0.7, block_len=BLOCK),
    f"threshold 0.7, blocks of {BLOCK}, prefix cache 4": _threshold(0.7, block_len=BLOCK, prefix_cache=4),
    f"first-hitting, whole-sequence blocks of {BLOCK}": SamplingPlan(sampler="first-hitting", block_len=BLOCK,
                                                                     whole_sequence=True),
    **{f"first-hitting, whole-sequence blocks of {BLOCK}, dual cache {n}": SamplingPlan(
        sampler="first-hitting", block_len=BLOCK, whole_sequence=True, dual_cache=n) for n in (2, 4, 8)},
    f"threshold 0.7, whole-sequence blocks of {BLOCK}, dual cache 4": _threshold(0.7, block_len=BLOCK,
                                                                                 whole_sequence=True, dual_cache=4),
}
# name -> plan whose cache's drift from the exact forward is measured: first-hitting in blocks.
DRIFT_PLANS = {
    **{f"prefix cache {n}": SamplingPlan(sampler="first-hitting", block_len=BLOCK, prefix_cache=n)
       for n in REFRESH_INTERVALS},
    **{f"dual cache {n}": SamplingPlan(sampler="first-hitting", block_len=BLOCK, whole_sequence=True, dual_cache=n)
       for n in REFRESH_INTERVALS},
}
# The rows that continue --prompt: first-hitting with unsupervised guidance (w = 0 is the model itself).
GUIDED_PLANS = {f"first-hitting after the prompt, guidance {w:g}": SamplingPlan(sampler="first-hitting", guidance=w)
                for w in (0.0, 0.5, 1.0)}
# The reference's own samples (one call per token against its KV cache), as `unmask sample` draws them.
REFERENCE_ROW = "autoregressive (the reference)"


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


def _interval(samples: list[Sample], quality) -> tuple[float, float, float]:
    """Pooled generative perplexity and its 95% interval: the ratio sum(nll) / sum(tokens) by the delta method."""
    nll = [score.reference_nll for score in quality.scores]
    tokens = [score.reference_tokens for score in quality.scores]
    ratio = sum(nll) / sum(tokens)
    mean_tokens = sum(tokens) / len(tokens)
    residual = sum((n - ratio * t) ** 2 for n, t in zip(nll, tokens)) / max(len(tokens) - 1, 1)
    error = (residual / len(tokens)) ** 0.5 / mean_tokens
    return math.exp(ratio), math.exp(ratio - 1.96 * error), math.exp(ratio + 1.96 * error)


def _selected_plans(args) -> dict[str, SamplingPlan | None]:
    """The --fast rows to run, by name: every row (the guided ones with --prompt), or --plans'
    (None for a reference row)."""
    known = {**FAST_PLANS, **GUIDED_PLANS, REFERENCE_ROW: None}
    if args.plans is None:
        return {name: plan for name, plan in known.items() if args.prompt is not None or name not in GUIDED_PLANS}
    return {name: known[name] if name in known else _plan_named(name) for name in args.plans}


def _plan_named(name: str) -> SamplingPlan:
    """'threshold X', or 'ancestral N' (N steps on the uniform grid: a distilled student's plan,
    docs/fast-generation.md#self-distillation)."""
    kind, _, value = name.rpartition(" ")
    return SamplingPlan(steps=int(value)) if kind == "ancestral" else _threshold(float(value))


def _row(name: str, seed: int, samples: list[Sample], seconds: float, quality, generated: int) -> dict:
    """A --fast row: ``generated`` tokens per sample (the sequence less the prompt's)."""
    perplexity, low, high = _interval(samples, quality)
    calls = sum(s.network_calls for s in samples) / len(samples)
    return {"plan": name, "seed": seed, "network_calls": calls, "seconds_per_sample": round(seconds, 3),
            "tokens_per_call": round(generated / calls, 2),
            "generative_perplexity": round(perplexity, 1), "interval": [round(low, 1), round(high, 1)],
            "mean_unigram_entropy": round(quality.mean_unigram_entropy, 3)}


def _fast_rows(exported: Exported, reference, args) -> list[dict]:
    rows = []
    for name, chosen in _selected_plans(args).items():
        for seed in args.seeds:
            start = time.perf_counter()
            if chosen is None:
                samples = _reference_samples(args.reference, seed, args)
            else:
                plan = replace(chosen, seed=seed, temperature=args.temperature, top_p=args.top_p)
                samples = generate(exported, plan, num=args.num, batch_size=args.batch_size, device="cpu",
                                   prompt=args.prompt if plan.guidance is not None else None)
            seconds = (time.perf_counter() - start) / len(samples)
            prompted = chosen is not None and chosen.guidance is not None
            generated = len(samples[0].tokens) - (len(exported.tokenizer.encode(args.prompt)) if prompted else 0)
            rows.append(_row(name, seed, samples, seconds, score_samples(samples, exported.tokenizer, reference),
                             generated))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _reference_samples(path: Path, seed: int, args) -> list[Sample]:
    """The reference's own samples, left to right at temperature 1 (one call per token)."""
    exported = load_export(resolve_export(path))
    plan = SamplingPlan(sampler="ancestral", steps=1, seed=seed, temperature=args.temperature, top_p=args.top_p)
    return generate(exported, plan, num=args.num, batch_size=args.batch_size, device="cpu")


class _Drift(WindowNetwork):
    """A cache's network that also runs the exact forward at every call and sums KL(exact || cached)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.kl = self.positions = self.stale_kl = self.stale_positions = 0.0

    def logits_at(self, z, t, selected):
        stale = self._caching() and bool((self.since[self.rows.cpu()] % self.refresh != 0).any())
        cached = super().logits_at(z, t, selected)
        exact = self.network.logits_at(self._whole(z), t, self._whole(selected, False))
        log_p, log_q = exact.double().log_softmax(-1), cached.double().log_softmax(-1)
        kl = float((log_p.exp() * (log_p - log_q)).sum())
        self.kl, self.positions = self.kl + kl, self.positions + exact.shape[0]
        if stale:
            self.stale_kl, self.stale_positions = self.stale_kl + kl, self.stale_positions + exact.shape[0]
        return cached


def _cache_drift(exported: Exported, args) -> list[dict]:
    """Mean KL(exact || cached) per predicted token, for each plan of ``DRIFT_PLANS`` (``--drift-plans``)."""
    process, rows = exported.process(validate=False), []
    with torch.no_grad():
        for name in args.drift_plans or DRIFT_PLANS:
            plan = replace(DRIFT_PLANS[name], seed=args.seeds[0])
            drift = _Drift(exported.network, plan, args.num, process.generate_id)
            process.sample(drift, plan, num_samples=args.num, seq_len=exported.network.config.max_seq_len,
                           window=exported.network.config.max_seq_len)
            rows.append({"cache": name, "refresh_every": drift.refresh, "mean_kl_nats": drift.kl / drift.positions,
                         "mean_kl_stale_calls_nats": drift.stale_kl / drift.stale_positions
                         if drift.stale_positions else 0.0,
                         "share_of_stale_predictions": drift.stale_positions / drift.positions})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _fast_table(rows: list[dict]) -> str:
    lines = [("| plan | network calls / sample | tokens / call | seconds / sample | generative perplexity (95%) | "
              "mean unigram entropy |"), "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['plan']} (seed {row['seed']}) | {row['network_calls']:.1f} | {row['tokens_per_call']} | "
                     f"{row['seconds_per_sample']:.3f} | {row['generative_perplexity']:.1f} "
                     f"({row['interval'][0]:.1f}-{row['interval'][1]:.1f}) | {row['mean_unigram_entropy']:.3f} |")
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
    parser.add_argument("--fast", action="store_true", help="measure fast generation (module docstring)")
    parser.add_argument("--plans", nargs="+", help="with --fast: these rows of FAST_PLANS only, or 'threshold X' "
                                                   "for any X, or 'ancestral N' for N steps (default: every row)")
    parser.add_argument("--no-drift", action="store_true", help="with --fast: skip the caches' KL")
    parser.add_argument("--drift-plans", nargs="+", choices=list(DRIFT_PLANS),
                        help="with --fast: these rows of DRIFT_PLANS only (default: every row)")
    parser.add_argument("--prompt", help="with --fast: the text the guided rows continue (default: no guided rows)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (1: times comparable on a "
                                                                "shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    exported = load_export(resolve_export(args.diffusion))
    reference = load_reference(args.reference)
    print(json.dumps({"diffusion": str(args.diffusion), "reference": str(args.reference), "num": args.num,
                      "seeds": args.seeds, "seq_len": exported.network.config.max_seq_len,
                      "samplers": list(args.samplers or sweep_samplers(exported)), "top_p": args.top_p,
                      "temperature": args.temperature, "prompt": args.prompt, "threads": args.threads,
                      "torch": torch.__version__,
                      "machine": platform.processor() or platform.machine()}), flush=True)
    if args.fast:
        drift = [] if args.no_drift else _cache_drift(exported, args)
        rows = _fast_rows(exported, reference, args)
        print(_fast_table(rows))
        print("\n".join(f"{row['cache']}: refresh every {row['refresh_every']}: mean KL {row['mean_kl_nats']:.2e} nats "
                        f"({row['mean_kl_stale_calls_nats']:.2e} on the {row['share_of_stale_predictions']:.0%} of "
                        f"predictions from a stale cache)" for row in drift))
        return
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

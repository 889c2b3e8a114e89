"""lm-eval's ``loglikelihood`` on CPU: continuation tokens scored per second (``evaluation.downstream.likelihoods``).

LAMBADA-shaped requests of random tokens (the cost does not depend on the token values): a
context of ``--context`` tokens and a continuation of ``--continuation`` (LAMBADA's last word is
one to three GPT-2 tokens). For a diffusion network, ``score_continuations`` draws K time samples
per request plus one greedy pass; for the causal network of the same shape it is one exact pass.
The baseline, measured in the same run, is ``estimate_bound`` (what ``unmask eval`` runs) with
the same K on the same rows, every position scored. The conditional bound costs the same K
passes plus its greedy one, but computes logits only at the continuation's positions where the
estimator computes them at every masked position: ``time_vs_unmask_eval`` is at most 1 + 1/K
(reached when the body, not the head, carries the cost) and well below it when the head dominates
(BENCHMARKS.md: 0.28 for tiny, 0.86 for small). Prints one JSON object per preset:

    .venv/bin/python bench/lm_eval_cpu.py --presets tiny small --requests 64 --samples 16
    .venv/bin/python bench/lm_eval_cpu.py --presets tiny --requests 8 --samples 2 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval_throughput import GPT2_VOCAB, _timed  # noqa: E402

from evaluation.bounds.estimator import Blocks, estimate_bound  # noqa: E402
from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations  # noqa: E402
from model.absorbing import AbsorbingDiffusion  # noqa: E402
from model.autoregressive import Autoregressive  # noqa: E402
from model.schedules import make_schedule  # noqa: E402
from model.transformer import Transformer, preset  # noqa: E402


def measure(name: str, requests: int, context: int, continuation: int, samples: int, batch_rows: int,
            repeats: int, vocab_size: int = GPT2_VOCAB) -> dict:
    torch.manual_seed(0)
    length = context + continuation
    rows = torch.randint(0, vocab_size, (requests, length))
    pairs = [(row[:context].tolist(), row[context:].tolist()) for row in rows]
    settings = ScoringSettings(samples=samples, seed=0, batch_rows=batch_rows)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), vocab_size, validate=False)
    bidirectional = Transformer(preset(name, vocab_size, max_seq_len=length)).eval()
    causal = Transformer(preset(name, vocab_size, max_seq_len=length, causal=True)).eval()
    models = {"diffusion": ScoringModel(diffusion, bidirectional, length),
              "autoregressive": ScoringModel(Autoregressive(vocab_size, validate=False), causal, length)}
    blocks = Blocks(rows, torch.ones_like(rows, dtype=torch.bool))

    def baseline() -> None:
        with torch.no_grad():
            estimate_bound(diffusion, bidirectional, blocks, samples_per_block=samples, batch_size=batch_rows)

    baseline_s = _timed(baseline, repeats)
    scored = requests * continuation
    out = {"preset": name, "vocab": vocab_size, "requests": requests, "context": context,
           "continuation": continuation, "samples": samples, "batch_rows": batch_rows,
           "unmask_eval_tokens_per_s": requests * length * samples / baseline_s}
    for kind, model in models.items():
        seconds = _timed(lambda: score_continuations(model, pairs, settings), repeats)
        out[f"{kind}_requests_per_s"] = requests / seconds
        out[f"{kind}_continuation_tokens_per_s"] = scored / seconds
        out[f"{kind}_time_vs_unmask_eval"] = seconds / baseline_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=96, help="context tokens per request (LAMBADA: ~80-100)")
    parser.add_argument("--continuation", type=int, default=2, help="continuation tokens per request")
    parser.add_argument("--samples", type=int, default=16, help="time samples per request K")
    parser.add_argument("--batch-rows", type=int, default=32, help="rows per forward pass")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in args.presets:
        print(json.dumps(measure(name, args.requests, args.context, args.continuation, args.samples,
                                 args.batch_rows, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

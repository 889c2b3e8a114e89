"""Forward+backward speed of the unmask denoiser next to a plain PyTorch reference.

For each preset it times one training step's forward and backward (no optimizer) of:
  reference    nn.TransformerEncoder (pre-norm, GELU, no bias) + tied head, CE at every position
  unmask_full  model.transformer.Transformer, CE at every position (same work + rotary)
  unmask_nelbo AbsorbingDiffusion.nelbo (the training loss): logits only at masked positions
The variants run interleaved, repeated, and the median is reported, because this machine
is noisy; ratios to the reference measured in the same run are the figures to compare.

    python bench/model_cpu.py [--presets tiny small] [--repeats 5]

Prints one JSON object per (preset, variant) line and a summary line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.transformer import Transformer, parameter_counts, preset

GPT2_VOCAB = 50257


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    batch: int
    seq_len: int


# Batch shapes sized so that one step takes seconds, not minutes, on two CPU cores.
SHAPES = {"tiny": Shape(vocab_size=4096, batch=8, seq_len=256),
          "small": Shape(vocab_size=GPT2_VOCAB, batch=2, seq_len=256),
          "medium": Shape(vocab_size=GPT2_VOCAB, batch=1, seq_len=256)}


class ReferenceEncoder(nn.Module):
    """The same shape built from stock PyTorch layers (learned positions instead of rotary)."""

    def __init__(self, vocab_size: int, layers: int, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size + 1, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width, bias=False)
        self.vocab_size = vocab_size

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.encoder(self.embed(z) + self.position[: z.shape[1]]))
        return F.linear(hidden, self.embed.weight[: self.vocab_size])


def _full_ce_step(model: Callable, z: torch.Tensor, x0: torch.Tensor, vocab: int) -> None:
    logits = model(z)
    F.cross_entropy(logits.float().view(-1, vocab), x0.view(-1)).backward()


def _time(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def bench_preset(name: str, repeats: int) -> list[dict]:
    shape = SHAPES[name]
    config = preset(name, shape.vocab_size, max_seq_len=max(shape.seq_len, 256))
    torch.manual_seed(0)
    ours = Transformer(config)
    reference = ReferenceEncoder(shape.vocab_size, config.n_layers, config.d_model, config.n_heads,
                                 shape.seq_len)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), shape.vocab_size)
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len), generator=generator)
    z = diffusion.corrupt(x0, torch.full((shape.batch,), 0.5, dtype=torch.float64), generator)
    variants: dict[str, Callable[[], None]] = {
        "reference": lambda: _full_ce_step(reference, z, x0, shape.vocab_size),
        "unmask_full": lambda: _full_ce_step(lambda t: ours(t), z, x0, shape.vocab_size),
        "unmask_nelbo": lambda: diffusion.nelbo(ours, x0, generator=generator,
                                                reconstruction="uniform").mean().backward(),
    }
    for step in variants.values():  # warm-up: allocator, thread pools
        step()
    times: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(repeats):
        for key, step in variants.items():
            ours.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            times[key].append(_time(step))
    tokens = shape.batch * shape.seq_len
    reference_median = statistics.median(times["reference"])
    return [{
        "preset": name, "variant": key, "batch": shape.batch, "seq_len": shape.seq_len,
        "vocab_size": shape.vocab_size, "params": parameter_counts(config).total,
        "median_s": round(statistics.median(values), 4), "min_s": round(min(values), 4),
        "tokens_per_s": round(tokens / statistics.median(values), 1),
        "time_vs_reference": round(statistics.median(values) / reference_median, 3),
    } for key, values in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "python": platform.python_version()}))
    for name in args.presets:
        for row in bench_preset(name, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

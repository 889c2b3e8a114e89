"""Train the fast-generation bench's two small models in this process and write them as exports:
an absorbing diffusion model (linear schedule, time-free) and its autoregressive reference, on
the same prepared data, for ``bench/sampler_quality.py --fast``.

A plain AdamW loop on one thread over random sequences of the prep's train split, the loss each
objective's own (the process's NELBO, the causal cross-entropy): on a busy shared 2-core machine
the full trainer (DeepSpeed, evaluation, checkpoints) ran at about 9 s/step for a tiny size, the
loop at 0.3 s/step. Not how to train a model worth keeping: how to get one worth sampling from
in minutes. Each model is scored on the prep's whole validation split (its full sequences): the
bound or NLL in nats/token and bits per byte, next to the unigram entropy of those tokens, the
floor of a model that ignores its context (what the measurement is worth depends on the gap:
BENCHMARKS.md says).

    python bench/tiny_models.py --data shards/ --out models/ [--steps 1500] [--layers 2 --width 64 --heads 2]
        [--seq-len 64] [--batch 32] [--lr 2e-3] [--clip 1.0] [--objectives diffusion autoregressive]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data_prep.shards.format import Manifest, iter_chunks
from data_prep.tokenizer.load import load_tokenizer
from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import Transformer, TransformerConfig
from pipeline.interchange.export import EXPORT_FORMAT_VERSION, write_export

EXPORT_NAMES = {"diffusion": "mdlm", "autoregressive": "ar"}
VALIDATION_PASSES = 4   # the bound draws t and the mask: average a few draws over the split


@dataclass(frozen=True)
class Recipe:
    """The network's shape and the loop's settings, from the flags."""

    layers: int
    width: int
    heads: int
    seq_len: int
    steps: int
    batch: int
    lr: float
    clip: float


def _split(data: Path, manifest: Manifest, name: str) -> torch.Tensor:
    """The split's full sequences [N, seq_len] (the last one, padded, is left out if it has padding)."""
    rows = []
    for shard in manifest.splits[name].shards:
        with open(data / shard.path, "rb") as stream:
            rows.extend(iter_chunks(stream, str(data / shard.path)))
    sequences = torch.from_numpy(np.concatenate(rows).astype(np.int64))                  # [N, seq_len]
    return sequences[:-1] if manifest.splits[name].padding_tokens else sequences


def _loss(network: Transformer, x: torch.Tensor, process: AbsorbingDiffusion | None) -> torch.Tensor:
    if process is not None:
        return process.nelbo(network, x).mean() / x.shape[1]
    start = torch.full((x.shape[0], 1), network.config.vocab_size, dtype=torch.long)
    logits = network(torch.cat([start, x[:, :-1]], dim=1))                 # [B, L, V]: token l from x_<l
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def _validate(network: Transformer, val: torch.Tensor, process: AbsorbingDiffusion | None) -> float:
    """Nats/token over every validation sequence (for the bound, the mean of a few draws)."""
    network.eval()
    torch.manual_seed(1)
    passes = VALIDATION_PASSES if process is not None else 1
    with torch.no_grad():
        total = sum(float(_loss(network, batch, process)) * len(batch)
                    for _ in range(passes) for batch in val.split(64))
    return total / (passes * len(val))


def train(objective: str, train_rows: torch.Tensor, vocab: int, recipe: Recipe) -> Transformer:
    torch.manual_seed(0)
    network = Transformer(TransformerConfig(vocab_size=vocab, causal=objective == "autoregressive",
                                            n_layers=recipe.layers, d_model=recipe.width, n_heads=recipe.heads,
                                            max_seq_len=recipe.seq_len))
    process = AbsorbingDiffusion(make_schedule("linear"), vocab) if objective == "diffusion" else None
    optimizer = torch.optim.AdamW(network.parameters(), lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=recipe.steps,
                                                   pct_start=0.05)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(recipe.steps):
        rows = torch.randint(0, len(train_rows), (recipe.batch,), generator=generator)
        loss = _loss(network, train_rows[rows], process)
        optimizer.zero_grad()
        loss.backward()
        # The bound's 1/t weight makes rare huge per-sequence losses: without clipping they upset AdamW.
        if recipe.clip:
            torch.nn.utils.clip_grad_norm_(network.parameters(), recipe.clip)
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == recipe.steps - 1:
            print(json.dumps({"objective": objective, "step": step, "loss": round(loss.item(), 4),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return network


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy (nats) of the tokens' empirical distribution: the best a context-free model does on them."""
    p = torch.bincount(tokens.flatten()).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="an `unmask prep` output (its splits and tokenizer)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, help="default: the prep's sequence length")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="the one-cycle schedule's peak")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    parser.add_argument("--objectives", nargs="+", choices=list(EXPORT_NAMES), default=list(EXPORT_NAMES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    manifest = Manifest.read(args.data)
    seq_len = args.seq_len or manifest.seq_len
    train_rows, val = (_split(args.data, manifest, name)[:, :seq_len] for name in ("train", "val"))
    tokenizer_dir = args.data / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_dir)
    recipe = Recipe(args.layers, args.width, args.heads, seq_len, args.steps, args.batch, args.lr, args.clip)
    split = manifest.splits["val"]
    tokens_per_byte = split.tokens / split.utf8_bytes
    print(json.dumps({"recipe": recipe.__dict__, "train_sequences": len(train_rows), "val_sequences": len(val),
                      "val_unigram_entropy_nats_per_token": round(unigram_entropy(val), 4),
                      "val_tokens_per_byte": round(tokens_per_byte, 4)}), flush=True)
    for objective in args.objectives:
        start = time.perf_counter()
        network = train(objective, train_rows, tokenizer.vocab_size, recipe)
        process = AbsorbingDiffusion(make_schedule("linear"), tokenizer.vocab_size) \
            if objective == "diffusion" else None
        validation = _validate(network, val, process)
        record = {"format_version": EXPORT_FORMAT_VERSION,
                  **ModelSpec(network=network.config, objective=objective).to_dict(), "weights": "model",
                  "step": args.steps, "tokenizer_sha256": tokenizer.sha256}
        write_export(args.out / EXPORT_NAMES[objective], network.state_dict(), record, tokenizer_dir)
        print(json.dumps({"objective": objective, "steps": args.steps, "validation_nats_per_token":
                          round(validation, 4), "validation_bits_per_byte":
                          round(validation * tokens_per_byte / math.log(2), 4),
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()

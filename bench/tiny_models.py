"""Train the fast-generation bench's two tiny models in this process and write them as exports:
an absorbing diffusion model (linear schedule, time-free) and its autoregressive reference, on
the same tokenizer, for ``bench/sampler_quality.py --fast``.

A plain AdamW loop on one thread over random windows of the tokenized corpus, the loss each
objective's own (the process's NELBO, the causal cross-entropy): on a busy shared 2-core machine
the full trainer (DeepSpeed, evaluation, checkpoints) ran at about 9 s/step for this size, the
loop at 0.3 s/step. Not how to train a model worth keeping: how to get one worth sampling from
in minutes. The validation NLL of each model is printed (and what the measurement is worth
depends on it: BENCHMARKS.md says).

    python bench/tiny_models.py --data shards/ --corpus input.txt --out models/ [--steps 1500]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.tokenizer.load import load_tokenizer
from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import Transformer, TransformerConfig
from pipeline.interchange.export import EXPORT_FORMAT_VERSION, write_export

SHAPE = {"n_layers": 2, "d_model": 64, "n_heads": 2, "max_seq_len": 64}


def _windows(ids: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - length, (batch,), generator=generator)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])   # [B, L]


def _loss(network: Transformer, x: torch.Tensor, process: AbsorbingDiffusion | None) -> torch.Tensor:
    if process is not None:
        return process.nelbo(network, x).mean() / x.shape[1]
    start = torch.full((x.shape[0], 1), network.config.vocab_size, dtype=torch.long)
    logits = network(torch.cat([start, x[:, :-1]], dim=1))                 # [B, L, V]: token l from x_<l
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def train(objective: str, ids: torch.Tensor, val: torch.Tensor, vocab: int, steps: int) -> tuple[Transformer, float]:
    torch.manual_seed(0)
    network = Transformer(TransformerConfig(vocab_size=vocab, causal=objective == "autoregressive", **SHAPE))
    process = AbsorbingDiffusion(make_schedule("linear"), vocab) if objective == "diffusion" else None
    optimizer = torch.optim.AdamW(network.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        loss = _loss(network, _windows(ids, 32, SHAPE["max_seq_len"], generator), process)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 250 == 0:
            print(json.dumps({"objective": objective, "step": step, "loss": round(loss.item(), 4)}), flush=True)
    network.eval()
    with torch.no_grad():
        held_out = _windows(val, 64, SHAPE["max_seq_len"], torch.Generator().manual_seed(1))
        validation = float(_loss(network, held_out, process))
    return network, validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="an `unmask prep` output (its tokenizer)")
    parser.add_argument("--corpus", type=Path, required=True, help="the text it was prepared from")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer_dir = args.data / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = torch.tensor(tokenizer.encode(args.corpus.read_text(encoding="utf-8")), dtype=torch.long)
    cut = int(ids.numel() * 0.95)
    for objective, name in (("diffusion", "mdlm"), ("autoregressive", "ar")):
        start = time.perf_counter()
        network, validation = train(objective, ids[:cut], ids[cut:], tokenizer.vocab_size, args.steps)
        record = {"format_version": EXPORT_FORMAT_VERSION,
                  **ModelSpec(network=network.config, objective=objective).to_dict(), "weights": "model",
                  "step": args.steps, "tokenizer_sha256": tokenizer.sha256}
        write_export(args.out / name, network.state_dict(), record, tokenizer_dir)
        print(json.dumps({"objective": objective, "steps": args.steps, "validation_nats_per_token":
                          round(validation, 4), "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()

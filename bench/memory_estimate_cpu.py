"""The activation memory estimate against what torch allocates on CPU, shape by shape.

For each tiny shape, precision (fp32, bf16 weights as DeepSpeed's bf16 holds them) and
activation checkpointing (off, on), one eager forward and backward of the loss at every
position (the estimate's worst case), gradients already allocated by an earlier step as in
training; the peak bytes torch's CPU allocator holds above what it held before (the
profiler's memory events, in order), next to pipeline.training.engine.activation_memory_bytes
(compiled=False). One JSON line per case. tests/pipeline/training/test_memory.py holds two of
these shapes to within 3% below and 8% above.

    python bench/memory_estimate_cpu.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.transformer import Block, Transformer, preset
from pipeline.training.engine import activation_memory_bytes  # noqa: E402
from tests.support.allocations import allocations_of  # noqa: E402

# (layers, d_model, heads, micro-batch, sequence length, vocabulary)
SHAPES = [(2, 64, 2, 8, 128, 211), (4, 64, 4, 4, 256, 211), (3, 32, 2, 16, 64, 97), (2, 64, 2, 8, 64, 2000),
          (2, 128, 4, 4, 128, 211)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(shape: tuple, precision: str, checkpointing: bool) -> dict:
    layers, width, heads, micro, length, vocab = shape
    config = preset("tiny", vocab, n_layers=layers, d_model=width, n_heads=heads, max_seq_len=length, vocab_multiple=1)
    torch.manual_seed(0)
    network = Transformer(config).to(DTYPES[precision])
    if checkpointing:
        apply_activation_checkpointing(network, check_fn=lambda module: isinstance(module, Block))
    masked, every = torch.full((micro, length), vocab), torch.ones(micro, length, dtype=torch.bool)
    targets = torch.randint(0, vocab, (micro * length,))

    def step() -> None:
        network.nll_at(masked, None, every, targets).sum().backward()

    step()
    measured = allocations_of(step).peak
    estimate = activation_memory_bytes(config, micro, length, precision, checkpointing=checkpointing, compiled=False)
    return {"bench": "memory_estimate", "layers": layers, "d_model": width, "micro_batch": micro, "seq_len": length,
            "vocab": vocab, "precision": precision, "checkpointing": checkpointing, "measured_bytes": measured,
            "estimated_bytes": int(estimate), "ratio": round(estimate / measured, 3)}


def main() -> None:
    torch.set_num_threads(1)
    for precision in DTYPES:
        for checkpointing in (False, True):
            for shape in SHAPES:
                print(json.dumps(measure(shape, precision, checkpointing)), flush=True)


if __name__ == "__main__":
    main()

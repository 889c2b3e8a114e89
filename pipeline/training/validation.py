"""Periodic validation during training: the bound per token on the val split, EMA weights.

The times and masks of validation batch i are seeded by (eval seed, i, rank), so every
validation of a run sees the same (t, z_t) and its curve measures the weights, not the
Monte Carlo noise. Bits per byte use the split's UTF-8 bytes per token from the manifest
(exact when the whole split is scored; a ratio estimate on a subset). The zero-shot
numbers of ``unmask eval`` score every token exactly once; this is a training monitor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice

import torch

from common.units import NATS_PER_BIT
from data_prep.shards.loader import StreamingLoader
from pipeline.distributed import Distributed
from pipeline.training.ema import EMA
from pipeline.training.objective import MicroBatchSlot, Objective

__all__ = ["ValidationResult", "validate"]


@dataclass(frozen=True)
class ValidationResult:
    nelbo_per_token: float      # nats
    tokens: int
    bytes_per_token: float

    @property
    def bits_per_token(self) -> float:
        return self.nelbo_per_token / NATS_PER_BIT

    @property
    def bits_per_byte(self) -> float:
        return self.bits_per_token / self.bytes_per_token

    @property
    def perplexity_bound(self) -> float:
        return math.exp(self.nelbo_per_token)

    def metrics(self) -> dict[str, float]:
        return {"val/nelbo_per_token": self.nelbo_per_token, "val/bits_per_token": self.bits_per_token,
                "val/bits_per_byte": self.bits_per_byte, "val/perplexity_bound": self.perplexity_bound}


@torch.no_grad()
def validate(network: torch.nn.Module, ema: EMA, objective: Objective, loader: StreamingLoader,
             batches: int | None, seed: int, dist: Distributed, bytes_per_token: float) -> ValidationResult:
    """The bound per token over the first ``batches`` batches of every rank (all: None)."""
    count = len(loader) if batches is None else min(batches, len(loader))
    loader.rewind()
    total = torch.zeros((), dtype=torch.float64, device=dist.device)
    tokens = 0
    network.eval()
    try:
        with ema.applied():
            for i, x0 in enumerate(islice(loader, count)):
                x0 = x0.to(dist.device, non_blocking=True)
                slot = MicroBatchSlot(seed=seed, step=i, rank=dist.rank, world_size=dist.world_size,
                                      micro=0, micro_batches=1)
                total += objective.loss_sum(network, x0, slot)
                tokens += x0.numel()
    finally:
        network.train()
    nelbo, tokens_all = dist.sum([total.item(), float(tokens)])
    return ValidationResult(nelbo / tokens_all, int(tokens_all), bytes_per_token)

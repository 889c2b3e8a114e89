"""Periodic validation during training: the bound per token on the val split, EMA weights.

The times and masks of validation batch i are seeded by (eval seed, i, rank), so every
validation of a run sees the same (t, z_t) and its curve measures the weights, not the
Monte Carlo noise. Bits per byte use the split's UTF-8 bytes per token from the manifest
(exact when the whole split is scored; a ratio estimate on a subset). A training monitor:
``unmask eval`` scores every token exactly once. The manual: docs/training.md#what-a-step-computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor, nn

from common.units import NATS_PER_BIT
from data_prep.shards.loader import StreamingLoader
from pipeline.distributed import Distributed
from pipeline.training.ema import EMA
from pipeline.training.objective import MicroBatchSlot, Objective, TrainedModel

__all__ = ["ValidationResult", "evaluating", "first_batches", "validate"]


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


@contextmanager
def evaluating(engine: nn.Module, ema: EMA) -> Iterator[None]:
    """Inside the block the engine is in eval mode with the EMA's weights; after it, in
    training mode with the live weights."""
    engine.eval()
    try:
        with ema.applied():
            yield
    finally:
        engine.train()


def _count(loader: StreamingLoader, batches: int | None) -> int:
    return len(loader) if batches is None else min(batches, len(loader))


def first_batches(loader: StreamingLoader, batches: int | None, device: torch.device) -> list[Tensor]:
    """The first ``batches`` batches of this rank (all: None), on ``device``, from the start."""
    loader.rewind()
    return [x0.to(device) for x0 in islice(loader, _count(loader, batches))]


@torch.no_grad()
def validate(model: TrainedModel, objective: Objective, loader: StreamingLoader, batches: int | None, seed: int,
             dist: Distributed, bytes_per_token: float) -> ValidationResult:
    """The bound per token over the first ``batches`` batches of every rank (all: None), of
    ``model`` as it is (run it inside ``evaluating``)."""
    count = _count(loader, batches)
    loader.rewind()
    total = torch.zeros((), dtype=torch.float64, device=dist.device)
    tokens = 0
    for i, x0 in enumerate(islice(loader, count)):
        x0 = x0.to(dist.device, non_blocking=True)
        slot = MicroBatchSlot(seed=seed, step=i, rank=dist.rank, world_size=dist.world_size, micro=0, micro_batches=1)
        total += objective.loss_sum(model, x0, slot)
        tokens += x0.numel()
    nelbo, tokens_all = dist.sum([total.item(), float(tokens)])
    return ValidationResult(nelbo / tokens_all, int(tokens_all), bytes_per_token)

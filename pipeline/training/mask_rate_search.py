"""Block diffusion's data-driven clipping: the masking-rate interval with the least loss variance.

With ``train.block_mask_rate_search`` the trainer searches at every validation, on the
validation batches with the EMA weights and the validation's seeds (every candidate sees the
same data, times and masks): ``interval_variances`` gives each candidate [beta, omega] of
``CANDIDATES`` the variance of its clipped loss per sequence over every rank, and the trainer
trains on the least's (``least_variance``) until the next validation. The manual:
docs/block-diffusion.md#train (BD3-LM's "data-driven noise schedules").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from model.denoiser import Denoiser
from pipeline.training.objective import DiffusionObjective, MicroBatchSlot

__all__ = ["CANDIDATES", "IntervalVariance", "interval_variances", "least_variance"]

# beta in {0, 0.1, 0.2, 0.3, 0.45} and omega in {0.5, 0.65, 0.8, 0.95, 1}: the paper's [0.3, 0.8]
# (L' = 16) and [0.45, 0.95] (L' = 4) among them.
_BETAS = (0.0, 0.1, 0.2, 0.3, 0.45)
_OMEGAS = (0.5, 0.65, 0.8, 0.95, 1.0)
CANDIDATES: tuple[tuple[float, float], ...] = tuple(itertools.product(_BETAS, _OMEGAS))

AllReduce = Callable[[list[float]], list[float]]


@dataclass(frozen=True)
class IntervalVariance:
    """One candidate's clipped training loss over the validation sequences (nats per token)."""

    interval: tuple[float, float]
    mean: float
    variance: float
    sequences: int


@torch.no_grad()
def interval_variances(bound: DiffusionObjective, denoiser: Denoiser, batches: list[Tensor], seed: int,
                       rank: int, world_size: int, all_reduce: AllReduce,
                       candidates: tuple[tuple[float, float], ...] = CANDIDATES) -> list[IntervalVariance]:
    """Each candidate's mean and variance of the clipped loss per sequence (nats per token;
    ``bound`` clipped to it), over ``batches`` (this rank's) and every rank's (``all_reduce``
    sums lists of floats), in ``candidates``' order."""
    sums = []
    for interval in candidates:
        clipped = bound.clipped(interval)
        total = square = count = 0.0
        for i, x0 in enumerate(batches):
            slot = MicroBatchSlot(seed=seed, step=i, rank=rank, world_size=world_size, micro=0, micro_batches=1)
            per_token = clipped.nelbo(denoiser, x0, slot) / x0.shape[1]
            total += float(per_token.sum())
            square += float((per_token ** 2).sum())
            count += per_token.numel()
        sums += [total, square, count]
    reduced = all_reduce(sums)
    records = []
    for index, interval in enumerate(candidates):
        total, square, count = reduced[3 * index:3 * index + 3]
        mean = total / count
        variance = (square - count * mean * mean) / (count - 1) if count > 1 else float("nan")
        records.append(IntervalVariance(tuple(interval), mean, variance, int(count)))
    return records


def least_variance(records: list[IntervalVariance]) -> IntervalVariance:
    """The candidate of the least variance (the first of equals)."""
    return min(records, key=lambda record: record.variance)

"""Block diffusion's data-driven clipping: the masking-rate interval with the least loss variance.

BD3-LM (Arriola et al. 2025, "data-driven noise schedules") trains each block at a masking
rate drawn in [beta, omega] instead of [0, 1] and picks the interval whose training loss has
the least variance on held-out data. With ``train.block_mask_rate_search`` the trainer does
that at every validation: on the validation batches (EMA weights, the validation's own seeds,
so every candidate sees the same data, times u and masks' uniforms: common random numbers), it
computes each candidate's clipped loss per sequence (nats per token; ``DiffusionObjective``
with ``mask_rate`` = the candidate), its variance over the sequences of every rank, and trains
on with the interval of the least variance until the next validation. The choice is logged
(``val/block_mask_rate_beta``, ``_omega``, ``val/block_mask_rate_loss_variance``) and kept in the
checkpoint, so a resumed run trains on it. The clipped loss is not a bound: what validation
reports stays the full one.

``CANDIDATES`` is the grid searched: beta in {0, 0.1, 0.2, 0.3, 0.45}, omega in {0.5, 0.65,
0.8, 0.95, 1}, the paper's [0.3, 0.8] (L' = 16) and [0.45, 0.95] (L' = 4) among them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from pipeline.training.objective import DiffusionObjective, MicroBatchSlot, _denoiser_of, row_generators

__all__ = ["CANDIDATES", "IntervalVariance", "interval_variances", "least_variance"]

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
def interval_variances(objective: DiffusionObjective, network: nn.Module, batches: list[Tensor], seed: int,
                       rank: int, world_size: int, all_reduce: AllReduce,
                       candidates: tuple[tuple[float, float], ...] = CANDIDATES) -> list[IntervalVariance]:
    """Each candidate's mean and variance of the clipped loss per sequence, over ``batches``
    (this rank's) and every rank's (``all_reduce`` sums lists of floats), in ``candidates``' order."""
    sums = []
    for interval in candidates:
        clipped = DiffusionObjective(objective.diffusion, interval)
        total = square = count = 0.0
        for i, x0 in enumerate(batches):
            slot = MicroBatchSlot(seed=seed, step=i, rank=rank, world_size=world_size, micro=0, micro_batches=1)
            times = clipped._block_times(x0, slot, clip=True).to(x0.device)
            masks = row_generators(x0.device, slot, x0.shape[0])
            per_token = clipped.diffusion.nelbo(_denoiser_of(network), x0, times, masks,
                                                reconstruction="uniform") / x0.shape[1]
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

"""Scored positions: which tokens of a batch a bound counts, and sums over them per sequence.

``positions`` (bool [B, L], True = a real token; None = every token) marks what a bound
scores: the other positions (the padding of a partial evaluation block) are never noised
and never scored. The bounds gather their per-position terms at N selected positions and
sum them back into their sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["count_scored", "scored_positions", "sum_by_row"]


def scored_positions(x0: Tensor, positions: Tensor | None) -> Tensor:
    """``positions``, or every position of x0 when None (bool [B, L])."""
    return torch.ones_like(x0, dtype=torch.bool) if positions is None else positions


def count_scored(positions: Tensor) -> Tensor:
    """Real tokens per sequence, float64 [B]."""
    return positions.sum(-1, dtype=torch.float64)


def sum_by_row(per_position: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    """Sum values of selected positions into their rows (``rows``: row of each), float64 [num_rows]."""
    return torch.zeros(num_rows, dtype=torch.float64, device=rows.device).index_add_(
        0, rows, per_position.to(torch.float64))

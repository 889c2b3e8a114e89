"""How the tests compare a random estimate or a sample with an exact value or law: z-scores,
Pearson's chi-square with its limit, and total variation. The tests use fixed seeds, so a check
that passes never flakes."""

from __future__ import annotations

import math

import torch

from tests.support.oracle import EnumerableDistribution

# One false alarm in 10^4 per check (the tests use fixed seeds, so it never flakes).
CHI_SQUARE_NORMAL_QUANTILE = 3.719


def z_scores(samples: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|mean - truth| / standard error, per column of ``samples`` [repeats, ...]."""
    standard_error = samples.std(0) / samples.shape[0] ** 0.5
    return (samples.mean(0) - truth).abs() / standard_error


def chi_square_statistic(samples: torch.Tensor, law: torch.Tensor, oracle: EnumerableDistribution) -> float:
    """Pearson's statistic of the sequences ``samples`` [N, L] against the probabilities ``law``
    over its support (infinite if a sample falls outside); int((law > 0).sum()) - 1 degrees of freedom."""
    counts = torch.bincount(oracle.index_of(samples), minlength=len(law)).double()
    support = law > 0
    if bool(counts[~support].any()):
        return math.inf
    expected = samples.shape[0] * law[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


def chi_square_limit(degrees_of_freedom: int) -> float:
    """The 1 - 1e-4 quantile of chi-square(k), by Wilson and Hilferty's cube-root normal
    approximation (about 1% high for k = 10, 2% for k = 5; no scipy needed)."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + CHI_SQUARE_NORMAL_QUANTILE * (2 / (9 * k)) ** 0.5) ** 3


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """The total variation distance of two laws over the same support: half their L1 distance."""
    return 0.5 * float((p - q).abs().sum())

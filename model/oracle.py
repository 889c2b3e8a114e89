"""An enumerable distribution with its exact conditionals: the optimal denoiser, for tests.

MATH.md's key identity: plugging the exact conditionals p(x_n | unmasked part of z) in as
the denoiser makes the continuous NELBO equal -log p(x) for every x and every schedule. This
module provides those conditionals for a distribution given as a table over all V^L
sequences, and the exact expectations of the bounds, so estimators can be checked against
numbers computed without Monte Carlo:

For a mask pattern M with k = |M| masked positions, the probability under q at time t is
(1 - alpha_t)^k alpha_t^(L-k), and since w(t) dt = d(alpha) / (1 - alpha) the diffusion
term integrates in closed form:

    E[diffusion] = sum_M CE(M) * integral_{alpha(1)}^{alpha(0)} (1 - a)^(k-1) a^(L-k) da,

where CE(M) = sum_{n in M} -log p(x_n | x outside M). Without the guard the integral is the
Beta function B(k, L-k+1), and the sum is the average over orders of autoregressive
factorizations, hence exactly -log p(x).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from model.schedules import Schedule

__all__ = ["EnumerableDistribution"]


def _integral_of_beta_kernel(k: int, length: int, low: float, high: float) -> float:
    """integral_low^high (1 - a)^(k-1) a^(length-k) da, by binomial expansion (small L)."""
    total = 0.0
    for j in range(k):
        power = length - k + j + 1
        total += math.comb(k - 1, j) * (-1) ** j * (high**power - low**power) / power
    return total


def _endpoint_alphas(schedule: Schedule) -> tuple[float, float]:
    """(alpha(0), alpha(1)) as floats."""
    alpha = schedule.alpha(torch.tensor([0.0, 1.0], dtype=torch.float64))
    return float(alpha[0]), float(alpha[1])


class EnumerableDistribution:
    """A distribution over sequences in {0..V-1}^L given by its probability table.

    ``probs[i]`` is the probability of the i-th sequence in lexicographic order
    (``itertools.product(range(V), repeat=L)``). Meant for V^L up to a few thousand.
    """

    def __init__(self, probs: Tensor, vocab_size: int, seq_len: int) -> None:
        if probs.shape != (vocab_size**seq_len,):
            raise ValueError(f"probs must have shape [{vocab_size}**{seq_len}], got {tuple(probs.shape)}")
        if bool((probs < 0).any()) or not math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9):
            raise ValueError("probs must be non-negative and sum to 1")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.probs = probs.to(torch.float64)
        self.sequences = torch.tensor(
            list(itertools.product(range(vocab_size), repeat=seq_len)), dtype=torch.long)
        self._onehot = torch.nn.functional.one_hot(self.sequences, vocab_size).to(torch.float64)

    @classmethod
    def random(cls, vocab_size: int, seq_len: int, generator: torch.Generator,
               spread: float = 2.0) -> "EnumerableDistribution":
        """softmax(spread * N(0, 1)) over all sequences: peaked, correlated, full support."""
        logits = spread * torch.randn(vocab_size**seq_len, generator=generator, dtype=torch.float64)
        return cls(torch.softmax(logits, 0), vocab_size, seq_len)

    # ------------------------------------------------------------------ exact quantities
    def index_of(self, x: Tensor) -> Tensor:
        """Row index of each sequence of ``x`` [B, L] in the table."""
        place = self.vocab_size ** torch.arange(self.seq_len - 1, -1, -1)
        return (x.cpu() * place).sum(-1)

    def log_prob(self, x: Tensor) -> Tensor:
        """Exact log p(x) per sequence, float64."""
        return self.probs[self.index_of(x)].log()

    def entropy(self) -> float:
        p = self.probs[self.probs > 0]
        return float(-(p * p.log()).sum())

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        index = torch.multinomial(self.probs, num_samples, replacement=True, generator=generator)
        return self.sequences[index]

    def conditional_logits(self, z: Tensor) -> Tensor:
        """log p(x_n = v | unmasked tokens of z) for every position: [B, L, V] (float64).

        Positions already unmasked get the point mass on their token, like any denoiser
        whose prediction there is ignored (SUBS carry-over).
        """
        mask_id = self.vocab_size
        z = z.cpu()
        consistent = ((z[:, None, :] == mask_id) | (z[:, None, :] == self.sequences[None])).all(-1)
        weights = consistent.to(torch.float64) * self.probs[None, :]               # [B, S]
        joint = torch.einsum("bs,slv->blv", weights, self._onehot)                 # [B, L, V]
        return joint.log() - weights.sum(-1).log()[:, None, None]

    def __call__(self, z: Tensor, t: Tensor) -> Tensor:
        """The optimal (time-independent) denoiser."""
        return self.conditional_logits(z).to(z.device)

    # ------------------------------------------------------------------ exact bounds
    def _masked_nll_by_pattern(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """For every mask pattern M: CE(M) per sequence [P, B] and |M| [P]."""
        patterns = torch.tensor(list(itertools.product([False, True], repeat=self.seq_len)))
        nll = torch.empty(len(patterns), x.shape[0], dtype=torch.float64)
        for i, mask in enumerate(patterns):
            z = torch.where(mask[None, :], self.vocab_size, x.cpu())
            logp = self.conditional_logits(z).gather(-1, x.cpu()[..., None]).squeeze(-1)
            nll[i] = -(logp * mask[None, :]).sum(-1)
        return nll, patterns.sum(-1)

    def _endpoint_terms(self, nll: Tensor, num_masked: Tensor, schedule: Schedule) -> Tensor:
        length = self.seq_len
        alpha0, alpha1 = _endpoint_alphas(schedule)
        pattern_prob = (1 - alpha0) ** num_masked * alpha0 ** (length - num_masked)
        reconstruction = (pattern_prob.to(torch.float64)[:, None] * nll).sum(0)
        return reconstruction + length * alpha1 * math.log(self.vocab_size)

    def exact_nelbo(self, x: Tensor, schedule: Schedule) -> Tensor:
        """The expectation of ``MaskedDiffusion.nelbo`` with this denoiser, per sequence."""
        nll, num_masked = self._masked_nll_by_pattern(x)
        alpha0, alpha1 = _endpoint_alphas(schedule)
        coefficient = torch.tensor(
            [_integral_of_beta_kernel(int(k), self.seq_len, alpha1, alpha0) if k > 0 else 0.0
             for k in num_masked], dtype=torch.float64)
        return (coefficient[:, None] * nll).sum(0) + self._endpoint_terms(nll, num_masked, schedule)

    def exact_nelbo_discrete(self, x: Tensor, schedule: Schedule, steps: int) -> Tensor:
        """The expectation of ``MaskedDiffusion.nelbo_discrete`` with this denoiser."""
        nll, num_masked = self._masked_nll_by_pattern(x)
        grid = torch.arange(steps + 1, dtype=torch.float64) / steps
        alpha = schedule.alpha(grid)
        total = torch.zeros(x.shape[0], dtype=torch.float64)
        for i in range(1, steps + 1):
            a_t, a_s = float(alpha[i]), float(alpha[i - 1])
            pattern_prob = (1 - a_t) ** num_masked * a_t ** (self.seq_len - num_masked)
            total += (a_s - a_t) / (1 - a_t) * (pattern_prob.to(torch.float64)[:, None] * nll).sum(0)
        return total + self._endpoint_terms(nll, num_masked, schedule)

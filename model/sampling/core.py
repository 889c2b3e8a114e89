"""What every sampler shares: the processes it reads, the token distribution of a plan, float64
inverse-CDF draws, per-row random numbers, and the network calls with what they cost.

With one generator per row, row b draws a fixed number of uniforms per step (or per event)
from its own generator, and only while it has positions to generate, so its sample depends
neither on its batch nor on the batch size (``sample_generators``: sample i of a seed is the
same in any batch). Tokens, masks and outputs live on the network's device; generators, the
time grid and per-row bookkeeping on the host, and they cross at named places
(``row_uniforms``, ``NetworkCalls``): docs/sampling.md#seeds-and-batches. ``NetworkCalls`` asks
the denoiser only for the rows that need it (with ``static_shape``, every row at every
position) and counts the calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from model.checks import check_logits, check_positive_int
from model.denoiser import Denoiser
from model.generators import Generators, seeded_generators
from model.sampling.plan import GRIDS, SamplingPlan
from model.schedules import Schedule

__all__ = ["MaskedProcess", "NetworkCalls", "ReverseKernelProcess", "SampledProcess", "SamplingStats", "inverse_cdf",
           "row_uniforms", "sample_generators", "time_grid", "token_probs", "top_p_filter"]


class SampledProcess(Protocol):
    """What every sampler reads of the process it samples (any ``model.process.DiffusionProcess``)."""

    vocab_size: int     # V clean tokens
    validate: bool      # check the prompt's token ids (a host sync)

    @property
    def generate_id(self) -> int:
        """The id (V) that marks, in a prompt, a position to generate."""


class MaskedProcess(SampledProcess, Protocol):
    """What the samplers that reveal masks read of a process: ``AbsorbingDiffusion`` and its
    subclasses (block diffusion, the learned schedules)."""

    schedule: Schedule

    @property
    def mask_id(self) -> int:
        """The absorbing state (V)."""


class ReverseKernelProcess(SampledProcess, Protocol):
    """What ``reverse_sample`` reads of a process: its prior and its reverse kernel
    (``LearnedDiffusion``, ``UniformDiffusion``)."""

    def prior_tokens(self, z: Tensor, free: Tensor, u: Tensor) -> Tensor:
        """z with its ``free`` positions drawn from the prior at t = 1 by the uniforms ``u`` [B, L]."""

    def changeable(self, z: Tensor) -> Tensor:
        """bool [B, L]: the positions whose reverse kernel is not the identity."""

    def reverse_kernel(self, z: Tensor, mu: Tensor, t: float, s: float | None) -> Tensor:
        """Weights over the states of z_s (up to a constant) for z_t = z and prediction mu [N, V];
        ``s=None`` on the last step (to t = 0)."""


@dataclass(frozen=True)
class SamplingStats:
    """What a sampling run cost."""

    steps: int | None          # the plan's budget per block (None: first-hitting, one call per token)
    network_calls: int         # denoiser invocations
    rows_evaluated: int        # sequences passed through the denoiser, summed over calls
    row_calls: tuple[int, ...]  # per sample: the calls whose output it needed


# ------------------------------------------------------------------ time and tokens
def time_grid(steps: int, grid: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """Times t_0 = 1 > t_1 > ... > t_T = 0 visited by the sampler.

    ``uniform``: t_i = 1 - i/T. ``cosine``: the grid g(x) = cos(pi/2 (1 - x)) (docs/math.md#sampling) read
    from x = 1 down to x = 0, so steps are short near t = 1 (the first tokens committed)
    and long near t = 0.
    """
    check_positive_int("steps", steps)
    x = 1.0 - torch.arange(steps + 1, dtype=dtype) / steps
    if grid == "uniform":
        return x
    if grid == "cosine":
        times = torch.cos(0.5 * math.pi * (1.0 - x))
        times[0], times[-1] = 1.0, 0.0  # cos(pi/2) is 6e-17, not 0
        return times
    raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalize."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = torch.where(mass_before < top_p, sorted_probs, 0.0)  # top-1 always kept
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def token_probs(logits: Tensor, plan: SamplingPlan) -> Tensor:
    """The plan's distribution over tokens, float64 [N, V]: softmax(logits / temperature), then
    the nucleus. float64 because float32 truncates small probabilities (docs/math.md#sampling)."""
    probs = torch.softmax(logits.to(torch.float64) / plan.temperature, dim=-1)
    if plan.top_p is not None and plan.top_p < 1.0:
        probs = top_p_filter(probs, plan.top_p)
    return probs


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Draw one index per row of ``probs`` (float64) from uniforms ``u`` in [0, 1)."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    # right=True skips zero-probability entries (equal consecutive cdf values).
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


# ------------------------------------------------------------------ randomness
def sample_generators(seed: int, indices: Iterable[int]) -> list[torch.Generator]:
    """CPU generators of the samples numbered ``indices`` under ``seed``: sample i's is seeded
    by a hash of (seed, i), so it is the same in every batch."""
    return [seeded_generators(seed, spawn_key=(index,))[0] for index in indices]


def row_uniforms(shape: tuple[int, ...], generator: Generators, rows: Tensor, device: torch.device) -> Tensor:
    """float64 U[0, 1) of shape [B, *shape]: rows where ``rows`` (bool [B]) is True draw them
    (each from its own generator when there is one per row), the others draw nothing (zeros)."""
    out = torch.zeros((rows.shape[0], *shape), dtype=torch.float64, device=device)
    if generator is None or isinstance(generator, torch.Generator):
        count = int(rows.sum())
        gen_device = generator.device if generator is not None else device
        drawn = torch.rand((count, *shape), generator=generator, dtype=torch.float64, device=gen_device).to(device)
        if count == rows.shape[0]:
            return drawn
        out[rows.to(device)] = drawn
        return out
    if len(generator) != rows.shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {rows.shape[0]} rows")
    chosen = rows.nonzero().flatten().tolist()
    if chosen:
        drawn = [torch.rand(shape, generator=generator[b], dtype=torch.float64, device=generator[b].device)
                 for b in chosen]
        out[chosen] = torch.stack(drawn).to(device)
    return out


# ------------------------------------------------------------------ the network
class NetworkCalls:
    """The denoiser as the samplers call it: only for the rows that need it (or, with
    ``static_shape``, all rows at all positions), counting the cost (module docstring)."""

    def __init__(self, denoiser: Denoiser, num_rows: int, vocab_size: int, *, static_shape: bool) -> None:
        self.denoiser, self.vocab_size, self.static_shape = denoiser, vocab_size, static_shape
        self.calls = self.rows_evaluated = 0
        self.row_calls = torch.zeros(num_rows, dtype=torch.long)

    @property
    def time_independent(self) -> bool:
        return self.denoiser.time_independent

    def _count(self, rows: Tensor, passed: int) -> None:
        self.calls += 1
        self.rows_evaluated += passed
        self.row_calls += rows.cpu().long()

    def logits_at(self, z: Tensor, t: Tensor, rows: Tensor, selected: Tensor) -> Tensor:
        """Logits [N, V] at the ``selected`` positions (bool [B, L], False outside ``rows``),
        row-major; ``t``: float64 [B] times; ``rows``: bool [B], the rows that need them."""
        t, rows, selected = t.to(z.device), rows.to(z.device), selected.to(z.device)   # the crossing (docstring)
        count = int(selected.sum())
        if self.static_shape:
            logits = self.denoiser.logits(z, t)[selected]
            self._count(rows, z.shape[0])
        else:
            logits = self.denoiser.logits_at(z[rows], t[rows], selected[rows])
            self._count(rows, int(rows.sum()))
        check_logits(logits, (count, self.vocab_size), self.vocab_size)
        return logits

    def logits(self, z: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        """Logits [R, L, V] of the R rows where ``rows`` is True (all positions)."""
        t, rows = t.to(z.device), rows.to(z.device)   # the crossing (module docstring)
        if self.static_shape:
            logits = self.denoiser.logits(z, t)[rows]
            self._count(rows, z.shape[0])
        else:
            logits = self.denoiser.logits(z[rows], t[rows])
            self._count(rows, int(rows.sum()))
        check_logits(logits, (int(rows.sum()), z.shape[1], self.vocab_size), self.vocab_size)
        return logits

    def stats(self, steps: int | None) -> SamplingStats:
        """The counts so far as ``SamplingStats`` of a run with ``steps`` steps."""
        return SamplingStats(steps=steps, network_calls=self.calls, rows_evaluated=self.rows_evaluated,
                             row_calls=tuple(self.row_calls.tolist()))

"""Ancestral sampling: masked diffusion with lazy network calls, and any process by its reverse kernel.

``ancestral_sample`` (the absorbing process): a reverse step from t to s < t moves a masked
position to token j with probability (alpha_s - alpha_t) / (1 - alpha_t) * p_theta(j | z_t)
and leaves it masked otherwise. We draw that in two stages: first whether the position is
unmasked (a coin whose bias does not involve the network), then which token (from the
network's prediction). The network is therefore needed only for sequences in which this
step unmasks something. For a time-independent network this is MDLM's caching (a step
that changes nothing reuses the last output), so T >> L costs at most L calls per
sequence; because the coin never looks at the network output, it is exact for
time-conditioned networks as well.

Both stages draw from float64 uniforms: two [N, L] tensors per step, whatever happens, so a
run with ``cache=False`` (the network called every step, the reference) consumes the same
random numbers and returns the same samples. Tokens are drawn by inverse CDF in float64:
float32 would truncate small probabilities and quietly lower the temperature.

``reverse_sample`` serves processes whose reverse step needs the prediction to decide
whether a position changes at all (GenMD4's state-dependent unmasking, uniform diffusion):
at every step, every position that can still change draws z_s from the process's reverse
kernel p(z_s | z_t) = sum_x mu(x) q(z_s | z_t, x), by inverse CDF from one float64 uniform
per position per step. The network is then needed at every step; its output is reused only
when the denoiser is ``time_independent`` (``model.denoiser``: its output depends on z_t
alone) and the row did not change since it was computed. Again the same uniforms are drawn whatever is
reused, so ``cache=False`` returns the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from model.checks import check_logits, check_positive_int, check_token_ids
from model.denoiser import DenoiserLike, as_denoiser
from model.schedules import Schedule

GRIDS = ("uniform", "cosine")

__all__ = ["GRIDS", "AbsorbingProcess", "ReverseProcess", "SampledProcess", "SamplingStats", "ancestral_sample",
           "inverse_cdf", "reverse_sample", "time_grid", "top_p_filter"]


class SampledProcess(Protocol):
    """What every sampler reads of its process."""

    vocab_size: int     # V clean tokens
    validate: bool      # check the prompt's token ids (a host sync)

    @property
    def generate_id(self) -> int:
        """The id (V) that marks, in a prompt, a position to generate."""


class AbsorbingProcess(SampledProcess, Protocol):
    """What ``ancestral_sample`` reads of an absorbing process (``MaskedDiffusion``)."""

    schedule: Schedule

    @property
    def mask_id(self) -> int:
        """The absorbing state (V)."""


class ReverseProcess(SampledProcess, Protocol):
    """What ``reverse_sample`` reads of a process: its prior and its reverse kernel."""

    def prior_tokens(self, z: Tensor, free: Tensor, generator: torch.Generator | None) -> Tensor:
        """z with its ``free`` positions drawn from the prior at t = 1."""

    def changeable(self, z: Tensor) -> Tensor:
        """bool [B, L]: the positions whose reverse kernel is not the identity."""

    def reverse_kernel(self, z: Tensor, mu: Tensor, t: float, s: float | None) -> Tensor:
        """Weights over the states of z_s (up to a constant) for z_t = z and prediction mu [N, V];
        ``s=None`` on the last step (to t = 0)."""


@dataclass(frozen=True)
class SamplingStats:
    """What a sampling run cost."""

    steps: int
    network_calls: int     # denoiser invocations
    rows_evaluated: int    # sequences passed through the denoiser, summed over calls


def time_grid(steps: int, grid: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """Times t_0 = 1 > t_1 > ... > t_T = 0 visited by the sampler.

    ``uniform``: t_i = 1 - i/T. ``cosine``: the MATH.md grid g(x) = cos(pi/2 (1 - x)) read
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


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Draw one index per row of ``probs`` (float64) from uniforms ``u`` in [0, 1)."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    # right=True skips zero-probability entries (equal consecutive cdf values).
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _initial_tokens(process: SampledProcess, num_samples: int, seq_len: int,
                    prompt: Tensor | None, device: torch.device) -> Tensor:
    """The prompt (or nothing) as [num_samples, seq_len], with ``generate_id`` where to generate."""
    if prompt is None:
        return torch.full((num_samples, seq_len), process.generate_id, dtype=torch.long, device=device)
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(num_samples, -1)
    if prompt.dim() != 2 or prompt.shape[1] != seq_len or prompt.shape[0] != num_samples:
        raise ValueError(f"prompt must have shape [{seq_len}] or [{num_samples}, {seq_len}], "
                         f"got {tuple(prompt.shape)}")
    check_token_ids(prompt, "prompt", process.generate_id, check_values=process.validate)
    return prompt.to(device).clone()


def _check_sizes(num_samples: int, seq_len: int, top_p: float | None) -> None:
    check_positive_int("num_samples", num_samples)
    check_positive_int("seq_len", seq_len)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def ancestral_sample(
    process: AbsorbingProcess,
    denoiser: DenoiserLike,
    *,
    num_samples: int,
    seq_len: int,
    steps: int,
    generator: torch.Generator | None = None,
    grid: str = "uniform",
    prompt: Tensor | None = None,
    top_p: float | None = None,
    cache: bool = True,
    device: torch.device | str | None = None,
) -> tuple[Tensor, SamplingStats]:
    """Sample ``num_samples`` sequences; see the module docstring.

    ``prompt`` (LongTensor [seq_len] or [num_samples, seq_len]) holds tokens to keep and the
    mask id where to generate: a prefix, a suffix or any infilling pattern. Positions still
    masked after the last step (alpha(0) < 1 under the endpoint guard) are filled from the
    last prediction.
    """
    _check_sizes(num_samples, seq_len, top_p)
    denoiser = as_denoiser(denoiser)
    times = time_grid(steps, grid)
    device = torch.device(device) if device is not None else (
        prompt.device if prompt is not None else torch.device("cpu"))
    z = _initial_tokens(process, num_samples, seq_len, prompt, device)
    alphas = process.schedule.alpha(times)
    unmask_prob = ((alphas[1:] - alphas[:-1]) / (1.0 - alphas[:-1])).tolist()
    unmask_prob[-1] = 1.0  # the last step fills every leftover mask
    calls = rows_evaluated = 0
    for step in range(steps):
        u_unmask = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=device)
        u_token = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=device)
        unmask = (z == process.mask_id) & (u_unmask < unmask_prob[step])
        rows = unmask.any(-1) if cache else torch.ones(num_samples, dtype=torch.bool, device=device)
        if not bool(rows.any()):
            continue
        t = torch.full((int(rows.sum()),), float(times[step]), dtype=torch.float64, device=device)
        logits = denoiser.logits(z[rows], t)
        check_logits(logits, (t.shape[0], seq_len, process.vocab_size), process.vocab_size)
        calls, rows_evaluated = calls + 1, rows_evaluated + t.shape[0]
        chosen = unmask[rows]
        probs = torch.softmax(logits[chosen].to(torch.float64), dim=-1)
        if top_p is not None and top_p < 1.0:
            probs = top_p_filter(probs, top_p)
        block = z[rows]
        block[chosen] = inverse_cdf(probs, u_token[rows][chosen])
        z[rows] = block
    return z, SamplingStats(steps=steps, network_calls=calls, rows_evaluated=rows_evaluated)


def reverse_sample(
    process: ReverseProcess,
    denoiser: DenoiserLike,
    *,
    num_samples: int,
    seq_len: int,
    steps: int,
    generator: torch.Generator | None = None,
    grid: str = "uniform",
    prompt: Tensor | None = None,
    top_p: float | None = None,
    cache: bool = True,
    device: torch.device | str | None = None,
) -> tuple[Tensor, SamplingStats]:
    """Sample by the process's reverse kernel, from its prior at t = 1 to t = 0 (module docstring).

    ``prompt`` as for ``ancestral_sample``: tokens to keep, ``process.generate_id`` (= V) where
    to generate; those positions start from the prior (the mask, or uniform tokens) and the
    kept ones never change. ``top_p`` filters the prediction mu before it enters the kernel.
    The last step (to t = 0) draws every changeable position from mu itself, as if
    alpha(0) = 1. The process provides its prior, the positions that can change and its
    kernel (``ReverseProcess``).
    """
    _check_sizes(num_samples, seq_len, top_p)
    denoiser = as_denoiser(denoiser)
    times = time_grid(steps, grid).tolist()
    device = torch.device(device) if device is not None else (
        prompt.device if prompt is not None else torch.device("cpu"))
    z = _initial_tokens(process, num_samples, seq_len, prompt, device)
    free = z == process.generate_id
    z = process.prior_tokens(z, free, generator)
    reuse = cache and denoiser.time_independent
    outputs: Tensor | None = None                     # last logits per row, when reused
    stale = torch.ones(num_samples, dtype=torch.bool, device=device)
    calls = rows_evaluated = 0
    for step in range(steps):
        u = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=device)
        active = free & process.changeable(z)
        rows = active.any(-1)
        if not bool(rows.any()):
            continue
        evaluate = rows & stale if reuse else rows
        if bool(evaluate.any()):
            t = torch.full((int(evaluate.sum()),), times[step], dtype=torch.float64, device=device)
            logits = denoiser.logits(z[evaluate], t)
            check_logits(logits, (t.shape[0], seq_len, process.vocab_size), process.vocab_size)
            calls, rows_evaluated = calls + 1, rows_evaluated + t.shape[0]
            if reuse:
                outputs = logits.new_empty((num_samples, seq_len, process.vocab_size)) if outputs is None else outputs
                outputs[evaluate], stale[evaluate] = logits, False
        block = outputs[rows] if reuse else logits
        mu = torch.softmax(block[active[rows]].to(torch.float64), dim=-1)
        if top_p is not None and top_p < 1.0:
            mu = top_p_filter(mu, top_p)
        last = step == steps - 1
        new = inverse_cdf(process.reverse_kernel(z[active], mu, times[step], None if last else times[step + 1]),
                          u[active])
        changed = torch.zeros_like(active)
        changed[active] = new != z[active]
        stale |= changed.any(-1)
        z[active] = new
    return z, SamplingStats(steps=steps, network_calls=calls, rows_evaluated=rows_evaluated)

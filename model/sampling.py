"""Ancestral sampling for masked diffusion, with lazy network calls.

A reverse step from t to s < t moves a masked position to token j with probability
(alpha_s - alpha_t) / (1 - alpha_t) * p_theta(j | z_t) and leaves it masked otherwise. We
draw that in two stages: first whether the position is unmasked (a coin whose bias does not
involve the network), then which token (from the network's prediction). The network is
therefore needed only for sequences in which this step unmasks something. For a
time-independent network this is MDLM's caching (a step that changes nothing reuses the
last output), so T >> L costs at most L calls per sequence; because the coin never looks at
the network output, it is exact for time-conditioned networks as well.

Both stages draw from float64 uniforms: two [N, L] tensors per step, whatever happens, so a
run with ``cache=False`` (the network called every step, the reference) consumes the same
random numbers and returns the same samples. Tokens are drawn by inverse CDF in float64:
float32 would truncate small probabilities and quietly lower the temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from model.diffusion import Denoiser, MaskedDiffusion

GRIDS = ("uniform", "cosine")

__all__ = ["GRIDS", "SamplingStats", "ancestral_sample", "inverse_cdf", "time_grid", "top_p_filter"]


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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
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


def _initial_tokens(diffusion: "MaskedDiffusion", num_samples: int, seq_len: int,
                    prompt: Tensor | None, device: torch.device) -> Tensor:
    if prompt is None:
        return torch.full((num_samples, seq_len), diffusion.mask_id, dtype=torch.long, device=device)
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(num_samples, -1)
    if prompt.dim() != 2 or prompt.shape[1] != seq_len or prompt.shape[0] != num_samples:
        raise ValueError(f"prompt must have shape [{seq_len}] or [{num_samples}, {seq_len}], "
                         f"got {tuple(prompt.shape)}")
    diffusion._check_tokens(prompt, "prompt", allow_mask=True)
    return prompt.to(device).clone()


def _check_sizes(num_samples: int, seq_len: int, top_p: float | None) -> None:
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def ancestral_sample(
    diffusion: "MaskedDiffusion",
    denoiser: "Denoiser",
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
    times = time_grid(steps, grid)
    device = torch.device(device) if device is not None else (
        prompt.device if prompt is not None else torch.device("cpu"))
    z = _initial_tokens(diffusion, num_samples, seq_len, prompt, device)
    alphas = diffusion.schedule.alpha(times)
    unmask_prob = ((alphas[1:] - alphas[:-1]) / (1.0 - alphas[:-1])).tolist()
    unmask_prob[-1] = 1.0  # the last step fills every leftover mask
    calls = rows_evaluated = 0
    for step in range(steps):
        u_unmask = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=device)
        u_token = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=device)
        unmask = (z == diffusion.mask_id) & (u_unmask < unmask_prob[step])
        rows = unmask.any(-1) if cache else torch.ones(num_samples, dtype=torch.bool, device=device)
        if not bool(rows.any()):
            continue
        t = torch.full((int(rows.sum()),), float(times[step]), dtype=torch.float64, device=device)
        logits = denoiser(z[rows], t)
        diffusion._check_logits(logits, (t.shape[0], seq_len, diffusion.vocab_size))
        calls, rows_evaluated = calls + 1, rows_evaluated + t.shape[0]
        chosen = unmask[rows]
        probs = torch.softmax(logits[chosen].to(torch.float64), dim=-1)
        if top_p is not None and top_p < 1.0:
            probs = top_p_filter(probs, top_p)
        block = z[rows]
        block[chosen] = inverse_cdf(probs, u_token[rows][chosen])
        z[rows] = block
    return z, SamplingStats(steps=steps, network_calls=calls, rows_evaluated=rows_evaluated)

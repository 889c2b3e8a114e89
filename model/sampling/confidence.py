"""Confidence-ordered unmasking (MaskGIT, Chang et al. 2022; LLaDA's low-confidence remasking).

Each step predicts every masked position, draws a token for each, and keeps the most confident
(``ConfidenceOptions.score``); the others stay masked. A decoding heuristic, not the model's
law. A step reveals as many positions as the forward process unmasks in expectation on the
plan's grid, so the sampler makes ``steps`` network calls while steps <= the tokens to
generate. docs/sampling.md#confidence-ordered-unmasking.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.generators import Generators
from model.sampling.core import MaskedProcess, NetworkCalls, inverse_cdf, row_uniforms, time_grid, token_probs
from model.sampling.plan import ConfidenceOptions, SamplingPlan

__all__ = ["confidence_sample", "confidence_scores", "masked_fraction"]


def masked_fraction(process: MaskedProcess, times: Tensor) -> Tensor:
    """f(t) = r(t) / r(1) at ``times`` (float64 [T]); per-value rates [T, V] are averaged."""
    with torch.no_grad():
        rate = process.schedule.masking_rate(times).reshape(times.shape[0], -1).mean(-1).cpu()
    return rate / rate[0]


def confidence_scores(probs: Tensor, options: ConfidenceOptions) -> Tensor:
    """The confidence [N] of each row of ``probs`` [N, V]: its largest probability (``max-prob``),
    or that minus the second largest (``margin``)."""
    if options.score == "margin":
        top = probs.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]
    return probs.max(-1).values


def confidence_sample(process: MaskedProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                      network: NetworkCalls) -> Tensor:
    """``plan.steps`` steps, each revealing the most confident masked positions (module docstring)."""
    steps = plan.steps
    times = time_grid(steps, plan.grid)
    fraction = masked_fraction(process, times)
    batch, length = z.shape
    masked = z == process.mask_id
    total = masked.sum(-1).cpu()
    live = total > 0
    spends_budget = total >= steps            # each step reveals >= 1 and leaves one per later step
    for step in range(steps):
        u = row_uniforms((length,), generator, live, z.device)
        remaining = masked.sum(-1).cpu()
        target = torch.round(total * fraction[step + 1]).long()
        spread = torch.minimum(target.clamp(min=steps - step - 1), remaining - 1)
        after = torch.where(spends_budget, spread, torch.minimum(target, remaining)).clamp(min=0)
        reveal = (remaining - after).to(z.device)
        rows = reveal > 0
        if not bool(rows.any()):
            continue
        selected = masked & rows[:, None]
        t = torch.full((batch,), float(times[step]), dtype=torch.float64)
        probs = token_probs(network.logits_at(z, t, rows, selected), plan)
        drawn = torch.zeros_like(z)
        drawn[selected] = inverse_cdf(probs, u[selected])
        score = torch.full(z.shape, -torch.inf, dtype=torch.float64, device=z.device)
        score[selected] = confidence_scores(probs, plan.options)
        order = score.argsort(dim=-1, descending=True, stable=True)                # [B, L] positions by confidence
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(length, device=z.device).expand(batch, -1))
        keep = selected & (rank < reveal[:, None])
        z[keep] = drawn[keep]
        masked &= ~keep
    return z

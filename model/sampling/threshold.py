"""Threshold decoding (Fast-dLLM, Wu et al. 2025): reveal, at each call, every masked position
the network is confident enough about.

A call predicts every masked position of the rows that still have some, draws a token for each
(the plan's temperature and nucleus) and keeps those whose confidence (``ThresholdOptions.score``)
exceeds ``threshold``; at least ``min_tokens`` (the most confident), at most ``max_tokens``.
With a budget (``plan.steps``) a call also reveals at least ceil(masked / calls left), so a
sequence (a block) never takes more than ``steps`` calls. The network sees the time at which
the schedule masks the fraction still masked. A row draws L uniforms per call while it has
masks, so its sample depends only on its own generator. A decoding heuristic, not the model's
law: docs/fast-generation.md#threshold-decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.generators import Generators
from model.sampling.confidence import confidence_scores
from model.sampling.core import MaskedProcess, NetworkCalls, inverse_cdf, row_uniforms, token_probs
from model.sampling.plan import SamplingPlan, ThresholdOptions

__all__ = ["reveal_counts", "threshold_sample"]


def reveal_counts(above: Tensor, remaining: Tensor, options: ThresholdOptions, calls_left: int | None) -> Tensor:
    """Positions each row reveals this call [B]: ``above`` (those over the threshold) kept within
    [min_tokens, max_tokens], at least ceil(remaining / calls_left) with a budget, at most ``remaining``."""
    floor = torch.full_like(remaining, options.min_tokens)
    if calls_left is not None:
        floor = torch.maximum(floor, -(-remaining // calls_left))
    count = torch.maximum(above, floor)
    if options.max_tokens is not None:
        count = count.clamp(max=options.max_tokens)
        if calls_left is not None:  # the budget wins over max_tokens
            count = torch.maximum(count, -(-remaining // calls_left))
    return torch.minimum(count, remaining)


def threshold_sample(process: MaskedProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                     network: NetworkCalls) -> Tensor:
    """Reveal the masks of ``z`` by confidence, as many per call as pass the threshold (module docstring)."""
    options: ThresholdOptions = plan.options
    batch, length = z.shape
    masked = z == process.mask_id
    total = masked.sum(-1).cpu()
    call = 0
    while True:
        remaining = masked.sum(-1).cpu()
        rows = remaining > 0
        if not bool(rows.any()):
            return z
        u = row_uniforms((length,), generator, rows, z.device)
        fraction = (remaining / total.clamp(min=1)).to(torch.float64)
        t = process.schedule.time_at_masking_rate(fraction)                        # [B] float64
        selected = masked & rows.to(z.device)[:, None]
        probs = token_probs(network.logits_at(z, t, rows, selected), plan)
        score = torch.full(z.shape, -torch.inf, dtype=torch.float64, device=z.device)
        score[selected] = confidence_scores(probs, options)
        above = (score > options.threshold).sum(-1).cpu()
        calls_left = None if plan.steps is None else max(plan.steps - call, 1)
        reveal = reveal_counts(above, remaining, options, calls_left).to(z.device)
        order = score.argsort(dim=-1, descending=True, stable=True)               # [B, L] positions by confidence
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(length, device=z.device).expand(batch, -1))
        keep = selected & (rank < reveal[:, None])
        drawn = torch.zeros_like(z)
        drawn[selected] = inverse_cdf(probs, u[selected])
        z[keep] = drawn[keep]
        masked &= ~keep
        call += 1

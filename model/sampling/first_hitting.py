"""First-hitting sampling (Zheng et al. 2024): the exact law of the continuous-time ancestral
sampler of the absorbing process, one network call per token.

A masked position's unmasking time tau has r(tau) / r(t) uniform, independently of the others
and of the network, so the next of n events is at r(tau) = r(t) U^(1/n), at a position uniform
among the n masks, and its token comes from one network call at tau. A budget below the tokens
to generate reveals k = ceil(n / steps) per call from one prediction (approximate); under the
endpoint guard, events below t = 0 leave the rest to one final call. A row draws 3k uniforms
per call (event times, positions, tokens) and L for the fill, only while it has masks.
The derivation: docs/sampling.md#first-hitting-derived.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.generators import Generators
from model.sampling.core import MaskedProcess, NetworkCalls, inverse_cdf, row_uniforms, token_probs
from model.sampling.plan import SamplingPlan

__all__ = ["first_hitting_sample"]

TIME, POSITION, TOKEN = range(3)   # the rows of a call's uniforms


def first_hitting_sample(process: MaskedProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                         network: NetworkCalls) -> Tensor:
    """Reveal the masks of ``z`` event by event (module docstring); kept tokens never change."""
    schedule = process.schedule
    masked = z == process.mask_id
    per_call = _tokens_per_call(masked.sum(-1).cpu(), plan.steps)                  # k [B]
    rate_end = float(schedule.masking_rate(torch.zeros(1, dtype=torch.float64)))
    rate_now = schedule.masking_rate(torch.ones(z.shape[0], dtype=torch.float64))  # r(t) per row, t = 1
    ended = torch.zeros(z.shape[0], dtype=torch.bool)   # an event fell below t = 0: fill next
    while True:
        remaining = masked.sum(-1).cpu()
        active = remaining > 0
        if not bool(active.any()):
            return z
        u = _event_uniforms(per_call, active, generator)                           # [B, 3, K]
        rate_event, valid = _event_rates(u[:, TIME], rate_now, remaining, per_call, rate_end, ended)
        events = valid.sum(-1)
        fill = active & (events == 0)
        chosen, order = _choose_positions(masked, u[:, POSITION], valid, remaining)
        chosen |= masked & fill.to(z.device)[:, None]
        first_event = schedule.time_at_masking_rate(rate_event[:, 0].clamp(min=rate_end))
        t = torch.where(fill, 0.0, first_event)
        probs = token_probs(network.logits_at(z, t, active.to(z.device), chosen), plan)
        u_fill = row_uniforms((z.shape[1],), generator, fill, z.device)
        u_token = u[:, TOKEN].to(z.device).gather(1, order.clamp(min=0))
        z[chosen] = inverse_cdf(probs, torch.where(fill.to(z.device)[:, None], u_fill, u_token)[chosen])
        masked &= ~chosen
        last = (events - 1).clamp(min=0)
        rate_now = torch.where(events > 0, rate_event.gather(1, last[:, None]).squeeze(1), rate_now)
        ended |= (events > 0) & (events < torch.minimum(per_call, remaining))


def _tokens_per_call(masks: Tensor, steps: int | None) -> Tensor:
    """k per row: 1 (exact) without a budget or within it, else ceil(masks / steps)."""
    if steps is None:
        return torch.ones_like(masks)
    return torch.div(masks + steps - 1, steps, rounding_mode="floor").clamp(min=1)


def _event_uniforms(per_call: Tensor, active: Tensor, generator: Generators) -> Tensor:
    """float64 [B, 3, K] (K = the largest k): row b draws 3 k_b uniforms from its own
    generator when it has one, others pad with 0; inactive rows draw nothing."""
    width = int(per_call.max())
    if generator is None or isinstance(generator, torch.Generator):
        return row_uniforms((3, width), generator, active, torch.device("cpu"))
    out = torch.zeros((active.shape[0], 3, width), dtype=torch.float64)
    for b in active.nonzero().flatten().tolist():
        k = int(per_call[b])
        out[b, :, :k] = torch.rand((3, k), generator=generator[b], dtype=torch.float64,
                                   device=generator[b].device).cpu()
    return out


def _event_rates(u_time: Tensor, rate_now: Tensor, remaining: Tensor, per_call: Tensor, rate_end: float,
                 ended: Tensor) -> tuple[Tensor, Tensor]:
    """The masking rates r(tau_j) of the next K events of each row [B, K] (the j-th largest of
    ``remaining`` uniform V's, times r(t)), and which of them happen in this call (a prefix):
    j < k, j < remaining, tau_j >= 0, and the row not ``ended``."""
    j = torch.arange(u_time.shape[1])
    left = (remaining[:, None] - j[None, :]).clamp(min=1).to(torch.float64)
    log_max = (u_time.log() / left).cumsum(-1)                                    # log M_j
    rate_event = rate_now[:, None] * log_max.exp()
    valid = ((j[None, :] < torch.minimum(per_call, remaining)[:, None]) & (rate_event >= rate_end)
             & ~ended[:, None])
    return rate_event, valid


def _choose_positions(masked: Tensor, u_position: Tensor, valid: Tensor, remaining: Tensor,
                      ) -> tuple[Tensor, Tensor]:
    """For each valid event j, a position uniform among the masks not yet chosen: bool [B, L]
    and the event index of each chosen position [B, L] (-1 elsewhere)."""
    device = masked.device
    chosen = torch.zeros_like(masked)
    order = torch.full(masked.shape, -1, dtype=torch.long, device=device)
    left = masked.clone()
    for j in range(valid.shape[1]):
        rows = valid[:, j].nonzero().flatten().to(device)
        if not rows.numel():
            break
        rank = torch.floor(u_position[:, j].to(device)[rows] * (remaining.to(device)[rows] - j)).long()
        # The (rank + 1)-th remaining mask: the count of positions whose running total is <= rank.
        position = (left[rows].cumsum(-1) <= rank[:, None]).sum(-1)
        chosen[rows, position], order[rows, position], left[rows, position] = True, j, False
    return chosen, order


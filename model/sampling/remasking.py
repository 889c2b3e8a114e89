"""Remasking (ReMDM, Wang et al. 2025): ancestral sampling of the absorbing process in which a
revealed token may be masked again, so that later steps can correct it, while every marginal
q(z_t | x) stays the forward process's.

A step from t to s < t masks a revealed token with probability sigma_t <= min(1, (1 - alpha_s)
/ alpha_t) and reveals a mask with probability (alpha_s - (1 - sigma_t) alpha_t) / (1 - alpha_t);
``RemaskOptions`` picks sigma_t (``cap``, ``rescale``, ``loop``). Like ``ancestral_sample`` it
calls the network only for rows that reveal a token. A row draws 3L uniforms per step (reveal,
token, remask); kept (prompt) tokens are never remasked. The derivation and the loop schedule:
docs/sampling.md#remdm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.generators import Generators
from model.sampling.core import MaskedProcess, NetworkCalls, inverse_cdf, row_uniforms, time_grid, token_probs
from model.sampling.plan import RemaskOptions, SamplingPlan
from model.schedules import Schedule

__all__ = ["RemaskSteps", "remask_sample", "remask_steps"]

REVEAL, TOKEN, REMASK = range(3)   # the rows of a step's uniforms


@dataclass(frozen=True)
class RemaskSteps:
    """Per step i (from t_i to t_(i+1)), float64 [T] each."""

    time: Tensor      # the schedule time the network sees
    reveal: Tensor    # probability that a masked position is revealed
    remask: Tensor    # sigma: probability that a revealed position is masked again


def _loop_times(schedule: Schedule, times: Tensor, options: RemaskOptions) -> Tensor:
    """tau(t) of the loop schedule (docs/sampling.md#remdm) at the grid ``times``."""
    t_star = schedule.time_at_masking_rate(torch.tensor([1.0 - options.alpha_on], dtype=torch.float64))
    above = t_star + (times - options.t_on) / (1.0 - options.t_on) * (1.0 - t_star)
    below = t_star * times / options.t_off
    return torch.where(times >= options.t_on, above, torch.where(times <= options.t_off, below, t_star))


def remask_steps(schedule: Schedule, steps: int, grid: str, options: RemaskOptions) -> RemaskSteps:
    """The network's time, the reveal and the remask probability of every step."""
    times = time_grid(steps, grid)
    t_i, s_i = times[:-1], times[1:]
    if options.schedule == "loop":
        tau = _loop_times(schedule, times, options)
        t_i, s_i = tau[:-1], tau[1:]
    alpha_t, alpha_s = schedule.alpha(t_i), schedule.alpha(s_i)
    sigma_max = ((1.0 - alpha_s) / alpha_t).clamp(max=1.0)
    if options.schedule == "cap":
        sigma = sigma_max.clamp(max=options.eta)
    elif options.schedule == "rescale":
        sigma = options.eta * sigma_max
    else:
        in_loop = (times[1:] >= options.t_off) & (times[:-1] <= options.t_on)
        sigma = torch.where(in_loop, sigma_max.clamp(max=options.eta), 0.0)
    reveal = ((alpha_s - (1.0 - sigma) * alpha_t) / (1.0 - alpha_t)).clamp(0.0, 1.0)
    reveal[-1], sigma[-1] = 1.0, 0.0   # the last step reveals every mask and remasks nothing
    return RemaskSteps(time=t_i, reveal=reveal, remask=sigma)


def remask_sample(process: MaskedProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                  network: NetworkCalls) -> Tensor:
    """``plan.steps`` ReMDM steps from all-mask at t = 1 to t = 0 (module docstring)."""
    schedule = remask_steps(process.schedule, plan.steps, plan.grid, plan.options)
    reveal, remask = schedule.reveal.tolist(), schedule.remask.tolist()
    batch, length = z.shape
    free = z == process.mask_id
    live = free.any(-1)
    for step in range(plan.steps):
        u = row_uniforms((3, length), generator, live, z.device)
        masked = z == process.mask_id
        unmask = masked & (u[:, REVEAL] < reveal[step])
        again = free & ~masked & (u[:, REMASK] < remask[step])
        rows = unmask.any(-1) if plan.cache else live
        if bool(rows.any()):
            t = torch.full((batch,), float(schedule.time[step]), dtype=torch.float64)
            probs = token_probs(network.logits_at(z, t, rows, unmask), plan)
            z[unmask] = inverse_cdf(probs, u[:, TOKEN][unmask])
        z[again] = process.mask_id
    return z

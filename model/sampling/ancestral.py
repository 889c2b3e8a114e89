"""Ancestral sampling: the absorbing process with lazy network calls, and any process by its reverse kernel.

``ancestral_sample`` draws each step in two stages, whether a masked position unmasks (a coin
that does not involve the network) and then its token, so it calls the network only for the
rows and positions a step unmasks (MDLM's caching, exact for time-conditioned networks too).
``reverse_sample`` (the learned and uniform processes) draws every position that can still
change from the process's reverse kernel at every step. Both draw the same float64 uniforms
whatever they reuse, so ``cache=False`` gives the same samples. Both take the tokens to start
from, the plan, the generators and the ``NetworkCalls`` that count their cost.
docs/sampling.md#ancestral-sampling.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.generators import Generators
from model.sampling.core import (
    MaskedProcess,
    NetworkCalls,
    ReverseKernelProcess,
    inverse_cdf,
    row_uniforms,
    time_grid,
    token_probs,
)
from model.sampling.plan import SamplingPlan

__all__ = ["ancestral_sample", "reverse_sample"]


def ancestral_sample(process: MaskedProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                     network: NetworkCalls) -> Tensor:
    """``plan.steps`` reverse steps from all-mask at t = 1 to t = 0 (module docstring).

    Positions still masked at the last step (alpha(0) < 1 under the endpoint guard) are
    filled from its prediction.
    """
    times = time_grid(plan.steps, plan.grid)
    alphas = process.schedule.alpha(times)
    unmask_prob = ((alphas[1:] - alphas[:-1]) / (1.0 - alphas[:-1])).tolist()
    unmask_prob[-1] = 1.0  # the last step fills every leftover mask
    batch, length = z.shape
    live = (z == process.mask_id).any(-1)  # rows with something to generate draw their uniforms
    for step in range(plan.steps):
        u = row_uniforms((2, length), generator, live, z.device)      # [B, 2, L]: unmask coin, token
        unmask = (z == process.mask_id) & (u[:, 0] < unmask_prob[step])
        rows = unmask.any(-1) if plan.cache else live
        if not bool(rows.any()):
            continue
        t = torch.full((batch,), float(times[step]), dtype=torch.float64)
        probs = token_probs(network.logits_at(z, t, rows, unmask), plan)
        z[unmask] = inverse_cdf(probs, u[:, 1][unmask])
    return z


def reverse_sample(process: ReverseKernelProcess, plan: SamplingPlan, z: Tensor, generator: Generators,
                   network: NetworkCalls) -> Tensor:
    """``plan.steps`` steps of the process's reverse kernel from its prior at t = 1 to t = 0.

    The ``generate_id`` positions of ``z`` start from the prior (the mask, or uniform
    tokens) and the kept ones never change. The plan's temperature and nucleus shape the
    prediction mu before it enters the kernel. The last step (to t = 0) draws every
    changeable position from mu itself, as if alpha(0) = 1.
    """
    times = time_grid(plan.steps, plan.grid).tolist()
    batch, length = z.shape
    free = z == process.generate_id
    live = free.any(-1)
    z = process.prior_tokens(z, free, row_uniforms((length,), generator, live, z.device))
    reuse = plan.cache and network.time_independent
    outputs: Tensor | None = None                     # last logits per row, when reused
    stale = torch.ones(batch, dtype=torch.bool, device=z.device)
    for step in range(plan.steps):
        u = row_uniforms((length,), generator, live, z.device)
        active = free & process.changeable(z)
        rows = active.any(-1)
        if not bool(rows.any()):
            continue
        evaluate = rows & stale if reuse else rows
        if bool(evaluate.any()):
            t = torch.full((batch,), times[step], dtype=torch.float64)
            logits = network.logits(z, t, evaluate)
            if reuse:
                outputs = logits.new_empty((batch, length, logits.shape[-1])) if outputs is None else outputs
                outputs[evaluate], stale[evaluate] = logits, False
        block = outputs[rows] if reuse else logits
        mu = token_probs(block[active[rows]], plan)
        last = step == plan.steps - 1
        new = inverse_cdf(process.reverse_kernel(z[active], mu, times[step], None if last else times[step + 1]),
                          u[active])
        changed = torch.zeros_like(active)
        changed[active] = new != z[active]
        stale |= changed.any(-1)
        z[active] = new
    return z

"""Ancestral sampling: masked diffusion with lazy network calls, and any process by its reverse kernel.

``ancestral_sample`` (the absorbing process): a reverse step from t to s < t moves a masked
position to token j with probability (alpha_s - alpha_t) / (1 - alpha_t) * p_theta(j | z_t)
and leaves it masked otherwise. We draw that in two stages: first whether the position is
unmasked (a coin whose bias does not involve the network), then which token (from the
network's prediction). The network is therefore needed only for sequences in which this
step unmasks something, and only at the positions it unmasks. For a time-independent network
this is MDLM's caching (a step that changes nothing reuses the last output), so T >> L costs
at most L calls per sequence; because the coin never looks at the network output, it is
exact for time-conditioned networks as well.

Both stages draw from float64 uniforms: 2L per row per step, whatever happens, so a run with
``cache=False`` (the network called every step, the reference) consumes the same random
numbers and returns the same samples. Tokens are drawn by inverse CDF in float64: float32
would truncate small probabilities and quietly lower the temperature.

``reverse_sample`` serves processes whose reverse step needs the prediction to decide
whether a position changes at all (GenMD4's state-dependent unmasking, uniform diffusion):
at every step, every position that can still change draws z_s from the process's reverse
kernel p(z_s | z_t) = sum_x mu(x) q(z_s | z_t, x), by inverse CDF from one float64 uniform
per position per step. The network is then needed at every step; its output is reused only
when the denoiser is ``time_independent`` (``model.denoiser``: its output depends on z_t
alone) and the row did not change since it was computed. Again the same uniforms are drawn
whatever is reused, so ``cache=False`` returns the same samples.

Both take the tokens to start from (kept tokens, ``generate_id`` where to generate), the
plan, the generators and the ``NetworkCalls`` that count their cost (``model.sampling.draw``).
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

"""GenMD4: masked diffusion with a learned schedule per token value.

Token value v masks at its own rate, alpha_{t,v} = (1 - 2 eps)(1 - t^{w_v}) + eps with
w_v = softplus(theta_v) (``LearnedSchedule``, theta [V] trained with the network). Every
value has alpha_{0,v} = 1 - eps and alpha_{1,v} = eps, so the endpoint terms are
``AbsorbingDiffusion``'s. ``LearnedDiffusion.nelbo`` is a surrogate: its value is the bound,
its gradient reaches theta through the pathwise term and a leave-one-out REINFORCE term over
K draws of z_t per sequence. The math: docs/math.md#learned-schedules-genmd4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.absorbing import AbsorbingDiffusion
from model.checks import (
    check_positive_int,
    check_reconstruction,
    check_schedule_times,
    check_vocab_size,
)
from model.denoiser import DenoiserLike
from model.generators import Generators, uniforms
from model.positions import sum_by_row
from model.process import NelboTerms, Reconstruction
from model.sampling import confidence_sample, reverse_sample
from model.schedules import DEFAULT_ENDPOINT_EPS, LinearSchedule, PolynomialSchedule, Schedule

__all__ = ["ExponentSpread", "LearnedDiffusion", "LearnedSchedule", "exponent_spread",
           "learned_schedule_arguments"]

# MD4's GenMD4 starts every exponent at 1: the linear schedule, alpha_raw = 1 - t.
DEFAULT_INITIAL_EXPONENT = 1.0
# MD4 draws z_t twice per sequence: the smallest number that allows a leave-one-out baseline.
DEFAULT_DRAWS = 2


class LearnedSchedule(nn.Module):
    """GenMD4's schedule alpha_{t,v} = 1 - t^{w_v}, w_v = softplus(theta_v), with MD4's guard.

    ``theta`` ([V], a Parameter) is trained with the network (put this module's parameters in
    the optimizer). Every method maps times of any shape [...] to [..., V] float64, on
    ``theta``'s device. ``exponents()`` are the w_v.
    """

    def __init__(self, vocab_size: int, *, initial_exponent: float = DEFAULT_INITIAL_EXPONENT,
                 endpoint_eps: float = DEFAULT_ENDPOINT_EPS) -> None:
        super().__init__()
        check_vocab_size(vocab_size)
        if not initial_exponent > 0:
            raise ValueError(f"initial_exponent must be > 0, got {initial_exponent}")
        if not 0.0 < endpoint_eps < 0.5:
            raise ValueError(f"endpoint_eps must lie in (0, 0.5), got {endpoint_eps}")
        self.endpoint_eps = float(endpoint_eps)
        # softplus^-1(w) = log(e^w - 1) = w + log(1 - e^-w), stable for large w.
        theta = initial_exponent + math.log(-math.expm1(-initial_exponent))
        self.theta = nn.Parameter(torch.full((vocab_size,), theta, dtype=torch.float32))

    @property
    def vocab_size(self) -> int:
        return self.theta.shape[0]

    def exponents(self) -> Tensor:
        """w_v = softplus(theta_v) > 0, float64 [V]."""
        return F.softplus(self.theta.to(torch.float64))

    def _power(self, t: Tensor, offset: float = 0.0) -> Tensor:
        """t^(w_v + offset) as [..., V]. At t = 0 it is 0^(w + offset) without a gradient:
        d/dw t^w = t^w log t is 0 * inf there."""
        check_schedule_times(t)
        t = t.to(device=self.theta.device, dtype=torch.float64)[..., None]
        exponent = self.exponents() + offset
        positive = t > 0
        inside = torch.where(positive, t, 1.0).pow(exponent)
        return torch.where(positive, inside, torch.zeros_like(t).pow(exponent.detach()))

    def masking_rate(self, t: Tensor) -> Tensor:
        """1 - alpha_{t,v} = eps + (1 - 2 eps) t^{w_v}."""
        eps = self.endpoint_eps
        return eps + (1.0 - 2.0 * eps) * self._power(t)

    def alpha(self, t: Tensor) -> Tensor:
        """alpha_{t,v} = (1 - eps) - (1 - 2 eps) t^{w_v}."""
        eps = self.endpoint_eps
        return (1.0 - eps) - (1.0 - 2.0 * eps) * self._power(t)

    def alpha_derivative(self, t: Tensor) -> Tensor:
        """alpha'_{t,v} = -(1 - 2 eps) w_v t^{w_v - 1} (-inf at t = 0 where w_v < 1)."""
        return -(1.0 - 2.0 * self.endpoint_eps) * self.exponents() * self._power(t, -1.0)

    def weight(self, t: Tensor) -> Tensor:
        """lambda_v(t) = -alpha'_{t,v} / (1 - alpha_{t,v}) >= 0, about w_v / t."""
        return -self.alpha_derivative(t) / self.masking_rate(t)

    def extra_repr(self) -> str:
        """The schedule's settings, for ``repr``."""
        return f"vocab_size={self.vocab_size}, endpoint_eps={self.endpoint_eps}"


def learned_schedule_arguments(start: Schedule) -> dict[str, float]:
    """``LearnedSchedule``'s arguments for exponents that all start where ``start`` is, with
    its guard: linear (w_v = 1) or polynomial (w_v = its power); other shapes are not of the
    form 1 - t^w and raise ValueError."""
    if isinstance(start, PolynomialSchedule):
        exponent = start.power
    elif isinstance(start, LinearSchedule):
        exponent = 1.0
    else:
        raise ValueError(f"the learned schedule 1 - t^w_v starts from a linear or polynomial schedule, "
                         f"not {start!r}")
    return {"initial_exponent": exponent, "endpoint_eps": start.endpoint_eps}


@dataclass(frozen=True)
class ExponentSpread:
    """How far the exponents w_v spread, and which token values unmask first and last.

    In the reverse process a masked position of clean value v stays masked from t to s < t
    with probability (1 - alpha_{s,v}) / (1 - alpha_{t,v}), about (s/t)^{w_v}: the larger
    w_v, the sooner (nearer t = 1) it unmasks when sampling. ``first`` holds the values of
    largest w, largest first; ``last`` those of smallest w, smallest first; each entry is
    (token id, w_v).
    """

    minimum: float
    median: float
    maximum: float
    first: tuple[tuple[int, float], ...]
    last: tuple[tuple[int, float], ...]


def exponent_spread(exponents: Tensor, count: int) -> ExponentSpread:
    """The spread of ``exponents`` (w [V], e.g. ``LearnedSchedule.exponents()``) with the
    ``count`` values that unmask first and last (fewer when V < count)."""
    check_positive_int("count", count)
    w = exponents.detach().to(device="cpu", dtype=torch.float64)
    order = w.argsort(descending=True, stable=True).tolist()
    first, last = order[:count], order[::-1][:count]
    return ExponentSpread(minimum=float(w.min()), median=float(w.quantile(0.5)), maximum=float(w.max()),
                          first=tuple((v, float(w[v])) for v in first), last=tuple((v, float(w[v])) for v in last))


@dataclass(frozen=True)
class _Draws:
    """K draws of z_t per sequence at its time t, flattened to B*K rows (row b*K + k)."""

    x: Tensor        # [BK, L] clean tokens
    t: Tensor        # [BK] float64
    z_t: Tensor      # [BK, L]
    masked: Tensor   # [BK, L]
    log_q: Tensor    # [B, K] log q(z_t | x, t), differentiable w.r.t. theta


class LearnedDiffusion(AbsorbingDiffusion):
    """GenMD4: ``AbsorbingDiffusion``'s interface and endpoint terms, with the learned
    schedule's forward process, bound and sampler.

    ``nelbo`` and ``nelbo_discrete`` average ``draws`` (K) draws of z_t per sequence at its
    time, as surrogates: the value is the bound estimate, the gradient the pathwise plus
    leave-one-out REINFORCE estimate for theta (docs/math.md#learned-schedules-genmd4). The
    baseline comes from the K draws of the same sequence, inside this call, so a trainer
    forms its batch as for ``AbsorbingDiffusion`` and pays K network passes per sequence.
    ``draws=1`` (no baseline, unbiased, noisy) is for scoring without a gradient. Evaluate
    with the schedule that was trained; exponents below 1/2 give the estimator infinite
    variance (watch ``schedule.exponents().min()``).
    """

    schedule_type = LearnedSchedule
    process_name = "learned"
    samplers = {"ancestral": reverse_sample, "confidence": confidence_sample}
    sampler_limits = {
        "first-hitting": "a token's unmasking rate depends on its value, which only the time-conditioned "
                         "network predicts, so the next unmasking time has no closed form",
        "remdm": "ReMDM's remasking posterior is built on one alpha_t shared by every token value",
        "threshold": "the time the network sees is where the schedule masks the fraction still masked, which per "
                     "token value has no single answer"}

    def __init__(self, schedule: LearnedSchedule, vocab_size: int, *, draws: int = DEFAULT_DRAWS,
                 validate: bool = True) -> None:
        super().__init__(schedule, vocab_size, validate=validate)
        if schedule.vocab_size != vocab_size:
            raise ValueError(f"schedule has {schedule.vocab_size} exponents for vocab_size={vocab_size}")
        check_positive_int("draws", draws)
        self.draws = draws

    # ---------------------------------------------------------------- forward process
    def _at_tokens(self, per_value: Tensor, x0: Tensor) -> Tensor:
        """A per-value quantity [B, V] read at each position's clean token: [B, L]."""
        return per_value.to(x0.device).gather(1, x0)

    def _corrupt(self, x0: Tensor, t: Tensor, generator: Generators,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            rate = self._at_tokens(self.schedule.masking_rate(t), x0)
        masked = uniforms(x0.shape, generator, x0.device) < rate
        if positions is not None:
            masked &= positions
        return torch.where(masked, self.mask_id, x0), masked

    def _draw(self, x0: Tensor, t: Tensor, generator: Generators, positions: Tensor | None) -> _Draws:
        batch, length = x0.shape
        rate = self._at_tokens(self.schedule.masking_rate(t), x0)[:, None]       # [B, 1, L]
        clean = self._at_tokens(self.schedule.alpha(t), x0)[:, None]
        masked = uniforms((batch, self.draws, length), generator, x0.device) < rate.detach()
        log_q = torch.where(masked, rate.log(), clean.log())
        if positions is not None:  # padding is never masked: no randomness, no score
            masked = masked & positions[:, None]  # not in place: log_q's backward reads the draws
            log_q = torch.where(positions[:, None], log_q, 0.0)
        x = x0.repeat_interleave(self.draws, 0)
        masked = masked.reshape(batch * self.draws, length)
        return _Draws(x=x, t=t.to(torch.float64).repeat_interleave(self.draws, 0),
                      z_t=torch.where(masked, self.mask_id, x), masked=masked, log_q=log_q.sum(-1))

    def _surrogate(self, loss: Tensor, log_q: Tensor) -> Tensor:
        """Mean over the K draws of f plus the leave-one-out score term: the value of the mean,
        the gradient of pathwise + RLOO REINFORCE (docs/math.md#learned-schedules-genmd4). loss, log_q: [B, K]."""
        draws = loss.shape[1]
        if draws > 1:
            baseline = (loss.sum(1, keepdim=True) - loss) / (draws - 1)
        else:
            baseline = torch.zeros_like(loss)
        score = (loss - baseline).detach() * (log_q - log_q.detach())
        return (loss + score).mean(1)

    # ---------------------------------------------------------------- bounds
    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *,
                    reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """``AbsorbingDiffusion.nelbo_terms`` for GenMD4: ``diffusion`` is the surrogate of the
        rate divergence summed over the masked positions (docs/math.md#learned-schedules-genmd4)
        over the K draws, ``num_masked`` their mean masked count."""
        self._check_x0(x0, positions)
        check_reconstruction(reconstruction)
        t = self._times(t, x0, generator)
        draws = self._draw(x0, t, generator, positions)
        loss = self._rate_divergence(denoiser, draws).view(x0.shape[0], self.draws)
        return NelboTerms(
            t=t,
            diffusion=self._surrogate(loss, draws.log_q),
            reconstruction=self._reconstruction(denoiser, x0, generator, reconstruction, positions),
            prior=self._prior(x0, positions),
            num_masked=draws.masked.sum(-1, dtype=torch.float64).view(-1, self.draws).mean(1),
        )

    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """``AbsorbingDiffusion.nelbo_discrete`` for GenMD4: T times the KL of the drawn step
        (docs/math.md#learned-schedules-genmd4), averaged over the K draws as a surrogate, plus
        the endpoint terms."""
        self._check_x0(x0, positions)
        t, s = self._step_times(steps, u, x0, generator)
        draws = self._draw(x0, t, generator, positions)
        loss = steps * self._step_kl(denoiser, draws, s.repeat_interleave(self.draws, 0))
        return (self._surrogate(loss.view(x0.shape[0], self.draws), draws.log_q)
                + self._reconstruction(denoiser, x0, generator, "model", positions)
                + self._prior(x0, positions))

    def _prediction(self, denoiser: DenoiserLike, draws: _Draws) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, clean tokens, log mu) at the masked positions. log mu is float32 for a
        network (bf16 logits are upcast, as in ``masked_nll``), float64 for float64 logits."""
        rows = draws.masked.nonzero(as_tuple=True)[0]
        t = draws.t.to(draws.x.device)
        logits = self._logits_at(denoiser, draws.z_t, t, draws.masked, rows.numel())
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return rows, draws.x[draws.masked], torch.log_softmax(logits.to(dtype), dim=-1)

    def _rate_divergence(self, denoiser: DenoiserLike, draws: _Draws) -> Tensor:
        """The diffusion term at t: the generalized KL between the true and the model's reverse
        jump rates, lambda_x (-log mu_x) + sum_v mu_v (lambda_v - lambda_x) summed over the masked
        positions of each draw (docs/math.md#learned-schedules-genmd4), float64 [BK]."""
        rows, target, log_mu = self._prediction(denoiser, draws)
        hazard = self.schedule.weight(draws.t).to(device=log_mu.device, dtype=log_mu.dtype)[rows]  # [N, V]
        hazard_x = hazard.gather(1, target[:, None])                                               # [N, 1]
        nll = -log_mu.gather(1, target[:, None])
        per_position = hazard_x * nll + (log_mu.exp() * (hazard - hazard_x)).sum(-1, keepdim=True)
        return sum_by_row(per_position.squeeze(1), rows, draws.x.shape[0])

    def _step_kl(self, denoiser: DenoiserLike, draws: _Draws, s: Tensor) -> Tensor:
        """KL(q(z_s | z_t, x) || p(z_s | z_t)) summed over the masked positions, float64 [BK]."""
        rows, target, log_mu = self._prediction(denoiser, draws)
        rate_t, rate_s = self.schedule.masking_rate(draws.t), self.schedule.masking_rate(s)   # [BK, V]
        stay = (rate_s / rate_t).to(device=log_mu.device, dtype=log_mu.dtype)[rows]              # 1 - a_v
        unmask = ((rate_t - rate_s) / rate_t).to(device=log_mu.device, dtype=log_mu.dtype)[rows]  # a_v
        stay_x, unmask_x = stay.gather(1, target[:, None]), unmask.gather(1, target[:, None])
        nll = -log_mu.gather(1, target[:, None])
        model_stay = torch.logsumexp(log_mu + stay.log(), dim=-1, keepdim=True)  # log sum_v mu_v (1 - a_v)
        per_position = unmask_x * nll + stay_x * (stay_x.log() - model_stay)
        return sum_by_row(per_position.squeeze(1), rows, draws.x.shape[0])

    def _endpoint_masking_rate(self, t: float) -> float:
        """1 - alpha at t = 0 or 1, the same for every token value (t^w is t there, whatever
        w > 0): in closed form, so the endpoint terms never wait for theta's device."""
        eps = self.schedule.endpoint_eps
        return eps + (1.0 - 2.0 * eps) * t

    # ---------------------------------------------------------------- sampling
    # Ancestral sampling runs the reverse step p(z_s | z_t) = sum_v mu_v q(z_s | z_t, v) through
    # ``reverse_sample``: unmasking depends on the prediction, so every step with a masked
    # position needs the network (an output is reused only for a ``time_independent``
    # denoiser and an unchanged row).
    def prior_tokens(self, z: Tensor, free: Tensor, u: Tensor) -> Tensor:
        """z with its ``free`` positions masked (the prior at t = 1; ``u`` is not needed)."""
        return torch.where(free, self.mask_id, z)

    def changeable(self, z: Tensor) -> Tensor:
        """The masked positions: only they change in a reverse step."""
        return z == self.mask_id

    def reverse_kernel(self, z: Tensor, mu: Tensor, t: float, s: float | None) -> Tensor:
        """Weights over the V tokens and the mask (last) of z_s for masked z_t = m: mu_v a_v
        and sum_v mu_v (1 - a_v); ``s=None`` is the last step, which unmasks everything."""
        if s is None:
            return F.pad(mu, (0, 1))
        with torch.no_grad():
            rate_t, rate_s = self.schedule.masking_rate(torch.tensor([t, s], dtype=torch.float64)).to(mu.device)
        unmask, stay = (rate_t - rate_s) / rate_t, rate_s / rate_t
        return torch.cat([mu * unmask, (mu * stay).sum(-1, keepdim=True)], dim=-1)

"""Masking schedules alpha(t): the probability that a token is still clean at time t.

Every schedule is its raw masking rate m(t) = 1 - alpha_raw(t), guarded at both ends as in
MD4: alpha(t) = (1 - 2 eps) alpha_raw(t) + eps, so every weight w(t) = -alpha'(t) / (1 - alpha(t))
is finite on [0, 1] and the bound carries both endpoint terms (``model.absorbing``). ``alpha``
and ``weight`` are computed from m(t) and m'(t) in closed form, never as ``1 - alpha``, so the
small masking rates near t = 0 keep full precision. docs/math.md#schedules.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from model.checks import check_schedule_times

# MD4's guard: alpha(0) = 1 - 1e-4. It costs about 1e-4 * log(V) nats per token in the
# prior term (0.001 nats/token for V = 50k) and keeps w(0) <= 1e4 for the linear schedule.
DEFAULT_ENDPOINT_EPS = 1e-4

# MDLM's log-linear schedule stops at alpha(1) = 1e-3.
DEFAULT_LOGLINEAR_EPS = 1e-3

__all__ = [
    "DEFAULT_ENDPOINT_EPS",
    "Schedule",
    "LinearSchedule",
    "CosineSchedule",
    "PolynomialSchedule",
    "LogLinearSchedule",
    "SCHEDULES",
    "check_schedule_arguments",
    "make_schedule",
]


class Schedule(ABC):
    """A guarded masking schedule (docs/math.md#schedules)."""

    name: str

    def __init__(self, endpoint_eps: float = DEFAULT_ENDPOINT_EPS) -> None:
        if not 0.0 < endpoint_eps < 0.5:
            raise ValueError(f"endpoint_eps must lie in (0, 0.5), got {endpoint_eps}")
        self.endpoint_eps = float(endpoint_eps)

    @abstractmethod
    def masking_rate_raw(self, t: Tensor) -> Tensor:
        """m(t) = 1 - alpha_raw(t), before the endpoint guard."""

    @abstractmethod
    def masking_rate_raw_derivative(self, t: Tensor) -> Tensor:
        """m'(t) = -alpha_raw'(t) >= 0."""

    @abstractmethod
    def masking_rate_raw_inverse(self, m: Tensor) -> Tensor:
        """The time t at which m(t) = m, for m in [0, m(1)]."""

    def masking_rate(self, t: Tensor) -> Tensor:
        """1 - alpha(t): the probability that a token is masked at time t."""
        check_schedule_times(t)
        eps = self.endpoint_eps
        return eps + (1.0 - 2.0 * eps) * self.masking_rate_raw(t)

    def alpha(self, t: Tensor) -> Tensor:
        """alpha(t): the probability that a token is still clean at time t."""
        check_schedule_times(t)
        eps = self.endpoint_eps
        return (1.0 - eps) - (1.0 - 2.0 * eps) * self.masking_rate_raw(t)

    def time_at_masking_rate(self, rate: Tensor) -> Tensor:
        """The time t at which 1 - alpha(t) = ``rate``, the inverse of ``masking_rate`` (rates
        outside [masking_rate(0), masking_rate(1)] give t = 0 or 1). The first-hitting sampler
        finds its event times with it."""
        eps = self.endpoint_eps
        raw = ((rate - eps) / (1.0 - 2.0 * eps)).clamp(0.0, 1.0)
        top = self.masking_rate_raw(torch.ones((), dtype=raw.dtype))
        return self.masking_rate_raw_inverse(torch.minimum(raw, top)).clamp(0.0, 1.0)

    def alpha_derivative(self, t: Tensor) -> Tensor:
        """alpha'(t) <= 0."""
        check_schedule_times(t)
        return -(1.0 - 2.0 * self.endpoint_eps) * self.masking_rate_raw_derivative(t)

    def weight(self, t: Tensor) -> Tensor:
        """w(t) = -alpha'(t) / (1 - alpha(t)) >= 0, the ELBO weight of the masked-token loss."""
        return -self.alpha_derivative(t) / self.masking_rate(t)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint_eps={self.endpoint_eps})"


class LinearSchedule(Schedule):
    """alpha_raw = 1 - t; w(t) = 1/t without the guard."""

    name = "linear"

    def masking_rate_raw(self, t: Tensor) -> Tensor:
        return t

    def masking_rate_raw_derivative(self, t: Tensor) -> Tensor:
        return torch.ones_like(t)

    def masking_rate_raw_inverse(self, m: Tensor) -> Tensor:
        return m


class CosineSchedule(Schedule):
    """MD4 / MaskGIT orientation: alpha_raw = 1 - cos(pi/2 (1 - t)).

    Unguarded weight: (pi/2) tan(pi/2 (1 - t)). The masking rate cos(pi/2 (1 - t)) rises
    fastest near t = 0 and lies above the linear rate t everywhere; w(1) = 0. (The other
    orientation in circulation, alpha = cos(pi/2 t), masks less than linear.)
    """

    name = "cosine"

    def masking_rate_raw(self, t: Tensor) -> Tensor:
        return torch.cos(0.5 * math.pi * (1.0 - t))

    def masking_rate_raw_derivative(self, t: Tensor) -> Tensor:
        return 0.5 * math.pi * torch.sin(0.5 * math.pi * (1.0 - t))

    def masking_rate_raw_inverse(self, m: Tensor) -> Tensor:
        return 1.0 - torch.acos(m) / (0.5 * math.pi)


class PolynomialSchedule(Schedule):
    """alpha_raw = 1 - t^power; w(t) = power/t without the guard."""

    name = "polynomial"

    def __init__(self, power: float = 1.0, endpoint_eps: float = DEFAULT_ENDPOINT_EPS) -> None:
        super().__init__(endpoint_eps)
        if not power >= 1:
            # m'(t) = k t^(k-1) is infinite at t = 0 for k < 1: w(0) would be infinite
            # even with the guard, and a draw of t = 0 would give an infinite loss.
            raise ValueError(f"power must be >= 1 (w(0) is infinite below 1), got {power}")
        self.power = float(power)

    def masking_rate_raw(self, t: Tensor) -> Tensor:
        return t.pow(self.power)

    def masking_rate_raw_derivative(self, t: Tensor) -> Tensor:
        return self.power * t.pow(self.power - 1.0)

    def masking_rate_raw_inverse(self, m: Tensor) -> Tensor:
        return m.pow(1.0 / self.power)

    def __repr__(self) -> str:
        return f"PolynomialSchedule(power={self.power}, endpoint_eps={self.endpoint_eps})"


class LogLinearSchedule(Schedule):
    """MDLM's log-linear schedule: alpha_raw = 1 - (1 - eps) t, so alpha_raw(1) = eps.

    Named for its noise sigma(t) = -log(1 - (1 - eps) t). Unguarded weight 1/t.
    """

    name = "loglinear"

    def __init__(self, eps: float = DEFAULT_LOGLINEAR_EPS,
                 endpoint_eps: float = DEFAULT_ENDPOINT_EPS) -> None:
        super().__init__(endpoint_eps)
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must lie in [0, 1), got {eps}")
        self.eps = float(eps)

    def masking_rate_raw(self, t: Tensor) -> Tensor:
        return (1.0 - self.eps) * t

    def masking_rate_raw_derivative(self, t: Tensor) -> Tensor:
        return torch.full_like(t, 1.0 - self.eps)

    def masking_rate_raw_inverse(self, m: Tensor) -> Tensor:
        return m / (1.0 - self.eps)

    def __repr__(self) -> str:
        return f"LogLinearSchedule(eps={self.eps}, endpoint_eps={self.endpoint_eps})"


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (LinearSchedule, CosineSchedule, PolynomialSchedule, LogLinearSchedule)
}


def make_schedule(name: str, **kwargs: float) -> Schedule:
    """Build a schedule by name: ``linear``, ``cosine``, ``polynomial`` (``power=k``) or
    ``loglinear`` (``eps``). Every schedule also takes ``endpoint_eps`` (the MD4 guard).

    >>> make_schedule("polynomial", power=2).weight(torch.tensor([0.5], dtype=torch.float64))
    tensor([3.9984], dtype=torch.float64)
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    check_schedule_arguments(name, SCHEDULES[name], kwargs)
    try:
        return SCHEDULES[name](**kwargs)
    except TypeError as err:
        raise ValueError(f"bad arguments for schedule {name!r}: {err}") from None


def check_schedule_arguments(name: str, schedule_type: type, arguments: dict, fixed: tuple[str, ...] = ()) -> None:
    """ValueError naming an argument the schedule ``name`` does not take, and those it takes
    (its keyword parameters but ``fixed``, which the caller supplies), rather than Python's signature error."""
    accepted = [p.name for p in list(inspect.signature(schedule_type.__init__).parameters.values())[1:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed]
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise ValueError(f"schedule {name!r} has no argument {unknown[0]!r}; it takes "
                         f"{', '.join(accepted) or 'none'}")

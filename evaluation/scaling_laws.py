"""Scaling laws from isoFLOP sweeps: Chinchilla's approach 2 and the compute multiplier.

Per process: each budget C's isoFLOP curve (loss against parameters N) is fitted by a parabola
in log N, whose vertex is that budget's optimum (N_opt, L_opt); the optima give the power laws
N_opt = k C^a and L_opt = k C^b, fitted by least squares in log-log with t intervals on the
coefficients. The compute multiplier of a process against a reference at a loss L is C_B(L) /
C_A(L) from the two L_opt laws (SMDM's "16x"), with a delta-method interval. Everything here is
pure numpy/scipy on given points: the sweep (orchestration.sweep) supplies them. The manual:
docs/scaling.md#the-fits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "INTERVAL",
    "ComputeMultiplier",
    "IsoflopMinimum",
    "PowerLaw",
    "ProcessFit",
    "compute_multiplier",
    "fit_process",
    "isoflop_minimum",
    "power_law",
]

INTERVAL = 0.95   # the coverage of every interval reported
MAX_LOG = 700.0   # exp of more is past float64: a multiplier that large is reported as inf


@dataclass(frozen=True)
class IsoflopMinimum:
    """The vertex of one budget's parabola L = c2 (ln N)^2 + c1 ln N + c0."""

    budget: float
    n_opt: float
    loss_opt: float
    coefficients: tuple[float, float, float]   # c2, c1, c0
    interior: bool                              # the vertex lies inside the sizes trained


@dataclass(frozen=True)
class PowerLaw:
    """y = k x^exponent, fitted as ln y = ln k + exponent ln x; intervals at ``INTERVAL``
    (None with too few points: two points fit exactly)."""

    coefficient: float
    exponent: float
    exponent_interval: tuple[float, float] | None
    log_coefficient_interval: tuple[float, float] | None
    covariance: tuple[tuple[float, float], tuple[float, float]] | None   # of (ln k, exponent)
    points: int

    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:
        """The law at ``x``."""
        return self.coefficient * np.asarray(x, dtype=float) ** self.exponent

    def inverse(self, y: float) -> float:
        """The x at which the law reaches y."""
        return math.exp((math.log(y) - math.log(self.coefficient)) / self.exponent)


@dataclass(frozen=True)
class ComputeMultiplier:
    """How many times the reference's compute a process needs to reach the same loss: None when
    a law does not fall with compute (exponent >= 0: no compute reaches a lower loss), inf past
    the floats (a law so flat that the loss is out of its reach)."""

    loss: float
    multiplier: float | None
    interval: tuple[float, float] | None


@dataclass(frozen=True)
class ProcessFit:
    """One process's minima and its two laws (None with fewer than two usable minima)."""

    minima: tuple[IsoflopMinimum, ...]
    n_opt: PowerLaw | None
    loss_opt: PowerLaw | None

    def to_json(self) -> dict:
        """The fit as plain JSON values (the sweep's ``summary.json``)."""
        return asdict(self)


def _t_quantile(dof: int) -> float:
    """Student's t quantile of the two-sided ``INTERVAL`` (scipy imported here: it costs every
    command line a second at its start)."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + INTERVAL / 2, dof))


def isoflop_minimum(budget: float, params: list[float], losses: list[float]) -> IsoflopMinimum | None:
    """The parabola's vertex for one budget; None with fewer than three sizes or a curve that
    does not open upwards (no minimum: the budget's sizes all lie on one side of it)."""
    if len(params) < 3:
        return None
    log_n = np.log(np.asarray(params, dtype=float))
    c2, c1, c0 = np.polyfit(log_n, np.asarray(losses, dtype=float), 2)
    if c2 <= 0:
        return None
    vertex = -c1 / (2 * c2)
    return IsoflopMinimum(budget=budget, n_opt=float(math.exp(vertex)), loss_opt=float(c0 - c1 * c1 / (4 * c2)),
                          coefficients=(float(c2), float(c1), float(c0)),
                          interior=bool(log_n.min() <= vertex <= log_n.max()))


def power_law(x: list[float], y: list[float]) -> PowerLaw:
    """Least squares of ln y on ln x; intervals from Student's t with n - 2 degrees of freedom."""
    log_x, log_y = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if len(log_x) < 2:
        raise ValueError("a power law needs at least two points")
    design = np.stack([np.ones_like(log_x), log_x], axis=1)   # (points, 2): ln k, exponent
    solution, *_ = np.linalg.lstsq(design, log_y, rcond=None)
    log_k, exponent = (float(v) for v in solution)
    dof = len(log_x) - 2
    if dof == 0:
        return PowerLaw(math.exp(log_k), exponent, None, None, None, len(log_x))
    residual = log_y - design @ solution
    covariance = float(residual @ residual) / dof * np.linalg.inv(design.T @ design)
    t = _t_quantile(dof)
    half_k, half_e = t * math.sqrt(covariance[0, 0]), t * math.sqrt(covariance[1, 1])
    return PowerLaw(math.exp(log_k), exponent, (exponent - half_e, exponent + half_e),
                    (log_k - half_k, log_k + half_k),
                    ((float(covariance[0, 0]), float(covariance[0, 1])),
                     (float(covariance[1, 0]), float(covariance[1, 1]))), len(log_x))


def fit_process(points: list[tuple[float, float, float]]) -> ProcessFit:
    """``points``: (budget, parameters, loss) of one process's finished trials."""
    minima = []
    for budget in sorted({p[0] for p in points}):
        curve = sorted((n, loss) for c, n, loss in points if c == budget)
        found = isoflop_minimum(budget, [n for n, _ in curve], [loss for _, loss in curve])
        if found is not None:
            minima.append(found)
    if len(minima) < 2:
        return ProcessFit(tuple(minima), None, None)
    budgets = [m.budget for m in minima]
    return ProcessFit(tuple(minima), power_law(budgets, [m.n_opt for m in minima]),
                      power_law(budgets, [m.loss_opt for m in minima]))


def _log_compute_gradient(law: PowerLaw, loss: float) -> tuple[float, np.ndarray]:
    """ln C(L) = (ln L - ln k) / b and its gradient in (ln k, b)."""
    log_k, b = math.log(law.coefficient), law.exponent
    value = (math.log(loss) - log_k) / b
    return value, np.array([-1.0 / b, -(math.log(loss) - log_k) / (b * b)])


def _exp(value: float) -> float:
    return math.exp(value) if value < MAX_LOG else math.inf


def compute_multiplier(reference: PowerLaw, other: PowerLaw, loss: float) -> ComputeMultiplier:
    """C_other(L) / C_reference(L) from two L_opt laws, with a delta-method interval (the fits
    independent; Student's t with the smaller fit's degrees of freedom) when both have covariances."""
    if reference.exponent >= 0 or other.exponent >= 0:
        return ComputeMultiplier(loss=loss, multiplier=None, interval=None)
    log_a, grad_a = _log_compute_gradient(reference, loss)
    log_b, grad_b = _log_compute_gradient(other, loss)
    log_m = log_b - log_a
    interval = None
    if reference.covariance is not None and other.covariance is not None:
        variance = (grad_a @ np.asarray(reference.covariance) @ grad_a
                    + grad_b @ np.asarray(other.covariance) @ grad_b)
        dof = min(reference.points, other.points) - 2
        half = _t_quantile(dof) * math.sqrt(max(float(variance), 0.0))
        interval = (_exp(log_m - half), _exp(log_m + half))
    return ComputeMultiplier(loss=loss, multiplier=_exp(log_m), interval=interval)

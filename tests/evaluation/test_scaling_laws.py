"""The scaling-law fits recover the laws that drew the losses: exponents, optima, multipliers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.scaling_laws import compute_multiplier, fit_process, isoflop_minimum, power_law

BUDGETS = [1e15, 3e15, 1e16, 3e16, 1e17]
N_EXPONENT, N_COEFFICIENT = 0.5, 0.08          # N_opt = 0.08 C^0.5
LOSS_EXPONENT, LOSS_COEFFICIENT = -0.05, 20.0   # L_opt = 20 C^-0.05
CURVATURE = 0.04                                # of the parabola in ln N


def _sweep(noise: float, seed: int, compute_scale: float = 1.0) -> list[tuple[float, float, float]]:
    """(budget, N, loss) on a known law: each isoFLOP curve a parabola in ln N around N_opt(C),
    its floor L_opt(C); ``compute_scale`` s makes a process that needs s times the compute."""
    rng = np.random.default_rng(seed)
    points = []
    for budget in BUDGETS:
        effective = budget / compute_scale
        n_opt = N_COEFFICIENT * effective ** N_EXPONENT
        floor = LOSS_COEFFICIENT * effective ** LOSS_EXPONENT
        for offset in np.linspace(-1.5, 1.5, 7):
            n = n_opt * math.exp(offset)
            points.append((budget, n, floor + CURVATURE * offset ** 2 + noise * rng.standard_normal()))
    return points


def test_a_parabola_vertex_is_the_minimum_of_its_points():
    params = [1e6, 2e6, 4e6, 8e6]
    losses = [(math.log(n) - math.log(3e6)) ** 2 + 2.0 for n in params]
    found = isoflop_minimum(1e15, params, losses)
    assert found.n_opt == pytest.approx(3e6, rel=1e-6) and found.loss_opt == pytest.approx(2.0, abs=1e-9)
    assert found.interior
    assert isoflop_minimum(1e15, params, [-v for v in losses]) is None   # opens downwards: no minimum
    assert isoflop_minimum(1e15, params[:2], losses[:2]) is None         # two sizes: no parabola


def test_exact_losses_give_the_law_exactly():
    fit = fit_process(_sweep(noise=0.0, seed=0))
    assert len(fit.minima) == len(BUDGETS)
    assert fit.n_opt.exponent == pytest.approx(N_EXPONENT, abs=1e-9)
    assert fit.n_opt.coefficient == pytest.approx(N_COEFFICIENT, rel=1e-6)
    assert fit.loss_opt.exponent == pytest.approx(LOSS_EXPONENT, abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_noisy_losses_recover_the_exponents_within_their_intervals(seed):
    fit = fit_process(_sweep(noise=0.003, seed=seed))
    low, high = fit.n_opt.exponent_interval
    assert low < N_EXPONENT < high and high - low < 0.2
    low, high = fit.loss_opt.exponent_interval
    assert low < LOSS_EXPONENT < high


def test_the_interval_covers_the_truth_at_about_its_level():
    """Over many draws the 95% interval of the N_opt exponent holds the true one about 95% of
    the time: the intervals are neither empty promises nor vacuous."""
    hits = 0
    draws = 200
    for seed in range(draws):
        low, high = fit_process(_sweep(noise=0.01, seed=seed)).n_opt.exponent_interval
        hits += low < N_EXPONENT < high
    assert 0.85 <= hits / draws <= 1.0


def test_chinchilla_loss_gives_its_analytic_exponent():
    """L = A/N^alpha + B/D^beta with D = C / 6N: N_opt grows as C^(beta / (alpha + beta))."""
    alpha, beta = 0.34, 0.28
    points = []
    for budget in BUDGETS:
        n_opt = (alpha * 400 / (beta * 410) * (budget / 6) ** beta) ** (1 / (alpha + beta))
        for n in n_opt * np.exp(np.linspace(-0.6, 0.6, 9)):
            points.append((budget, n, 400 / n ** alpha + 410 / (budget / (6 * n)) ** beta))
    assert fit_process(points).n_opt.exponent == pytest.approx(beta / (alpha + beta), abs=0.01)


def test_the_multiplier_of_a_process_that_needs_sixteen_times_the_compute_is_sixteen():
    loss = LOSS_COEFFICIENT * 1e16 ** LOSS_EXPONENT
    hits, draws = 0, 100
    for seed in range(draws):
        reference = fit_process(_sweep(noise=0.002, seed=2 * seed)).loss_opt
        other = fit_process(_sweep(noise=0.002, seed=2 * seed + 1, compute_scale=16.0)).loss_opt
        result = compute_multiplier(reference, other, loss)
        assert result.multiplier == pytest.approx(16.0, rel=0.5)
        hits += result.interval[0] < 16.0 < result.interval[1]
    assert hits / draws >= 0.85
    exact = compute_multiplier(fit_process(_sweep(0.0, 0)).loss_opt,
                               fit_process(_sweep(0.0, 0, compute_scale=16.0)).loss_opt, loss)
    assert exact.multiplier == pytest.approx(16.0, rel=1e-6)


def test_two_points_fit_exactly_with_no_interval():
    law = power_law([1.0, 10.0], [2.0, 20.0])
    assert law.exponent == pytest.approx(1.0) and law.exponent_interval is None
    assert law.inverse(20.0) == pytest.approx(10.0)


def test_a_law_that_does_not_fall_has_no_multiplier_and_a_flat_one_an_infinite_one():
    falling = power_law([1e15, 1e16, 1e17], [4.0, 3.5, 3.1])
    flat = power_law([1e15, 1e16, 1e17], [4.0, 3.9999, 3.9998])
    rising = power_law([1e15, 1e16, 1e17], [3.0, 3.1, 3.2])
    assert compute_multiplier(falling, rising, 3.5).multiplier is None
    far = compute_multiplier(falling, flat, 3.1)   # the flat law reaches 3.1 at C ~ 10^(thousands)
    assert far.multiplier == math.inf and far.interval[1] == math.inf

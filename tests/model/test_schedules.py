"""Schedules: weights equal -alpha'/(1 - alpha), the formulas of docs/math.md#schedules, the endpoint guard."""

import math

import pytest
import torch

from model.schedules import DEFAULT_ENDPOINT_EPS, SCHEDULES, make_schedule

ALL = [("linear", {}), ("cosine", {}), ("polynomial", {"power": 2.0}),
       ("polynomial", {"power": 3.5}), ("loglinear", {"eps": 1e-3})]
INTERIOR = torch.linspace(0.02, 0.98, 49, dtype=torch.float64)


@pytest.mark.parametrize("name,kwargs", ALL)
def test_weight_is_minus_alpha_derivative_over_masking_rate(name, kwargs):
    schedule = make_schedule(name, **kwargs)
    h = 1e-6
    finite_difference = (schedule.alpha(INTERIOR + h) - schedule.alpha(INTERIOR - h)) / (2 * h)
    expected = -finite_difference / (1 - schedule.alpha(INTERIOR))
    torch.testing.assert_close(schedule.weight(INTERIOR), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name,kwargs", ALL)
def test_time_at_masking_rate_inverts_the_masking_rate(name, kwargs):
    """The first-hitting sampler's event times: t from 1 - alpha(t), ends clamped."""
    schedule = make_schedule(name, **kwargs)
    t = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)
    torch.testing.assert_close(schedule.time_at_masking_rate(schedule.masking_rate(t)), t, rtol=0, atol=1e-9)
    ends = schedule.time_at_masking_rate(torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert ends.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("name,kwargs", ALL)
def test_alpha_derivative_matches_autograd(name, kwargs):
    schedule = make_schedule(name, **kwargs)
    t = INTERIOR.clone().requires_grad_()
    (grad,) = torch.autograd.grad(schedule.alpha(t).sum(), t)
    torch.testing.assert_close(schedule.alpha_derivative(INTERIOR), grad)


UNGUARDED = {  # docs/math.md's table, without the endpoint guard
    "linear": (lambda t: 1 - t, lambda t: 1 / t),
    "cosine": (lambda t: 1 - torch.cos(math.pi / 2 * (1 - t)),
               lambda t: math.pi / 2 * torch.tan(math.pi / 2 * (1 - t))),
    "polynomial": (lambda t: 1 - t**3, lambda t: 3 / t),
    "loglinear": (lambda t: 1 - (1 - 1e-3) * t, lambda t: 1 / t),
}


@pytest.mark.parametrize("name", sorted(UNGUARDED))
def test_formulas_of_math_md(name):
    kwargs = {"power": 3.0} if name == "polynomial" else {}
    schedule = make_schedule(name, endpoint_eps=1e-12, **kwargs)
    alpha, weight = UNGUARDED[name]
    torch.testing.assert_close(schedule.alpha(INTERIOR), alpha(INTERIOR), rtol=1e-9, atol=1e-11)
    # The guard changes w by a relative eps / m(t), at most 1e-12 / 0.02^3 here.
    torch.testing.assert_close(schedule.weight(INTERIOR), weight(INTERIOR), rtol=1e-6, atol=0)


def test_cosine_is_md4_orientation():
    """MD4: alpha = 1 - cos(pi/2 (1 - t)): more masked than linear at every t, w(1) = 0.

    The other orientation in circulation, alpha = cos(pi/2 t), masks less than linear."""
    schedule = make_schedule("cosine", endpoint_eps=1e-12)
    assert float(schedule.alpha(torch.tensor([0.25], dtype=torch.float64))) == pytest.approx(
        1 - math.cos(3 * math.pi / 8))
    assert bool((schedule.alpha(INTERIOR) < 1 - INTERIOR).all())
    assert float(schedule.weight(torch.ones(1, dtype=torch.float64))) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("name,kwargs", ALL)
def test_endpoint_guard(name, kwargs):
    eps = DEFAULT_ENDPOINT_EPS
    schedule = make_schedule(name, **kwargs)
    ends = torch.tensor([0.0, 1.0], dtype=torch.float64)
    alpha = schedule.alpha(ends)
    assert float(alpha[0]) == pytest.approx(1 - eps, abs=1e-15)
    alpha_one = eps + (1 - 2 * eps) * kwargs.get("eps", 0.0)
    assert float(alpha[1]) == pytest.approx(alpha_one, abs=1e-15)
    weight = schedule.weight(ends)
    assert bool(torch.isfinite(weight).all()) and bool((weight >= 0).all())
    grid = torch.linspace(0, 1, 1001, dtype=torch.float64)
    assert bool((schedule.alpha(grid).diff() < 0).all()), "alpha must decrease"
    assert bool((schedule.weight(grid) >= 0).all())


def test_linear_weight_at_zero_is_bounded_by_guard():
    eps = 1e-3
    schedule = make_schedule("linear", endpoint_eps=eps)
    assert float(schedule.weight(torch.zeros(1, dtype=torch.float64))) == pytest.approx((1 - 2 * eps) / eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_elementwise_and_dtype_preserving(name, dtype):
    schedule = make_schedule(name)
    t = torch.rand(3, 5, dtype=dtype)
    for method in (schedule.alpha, schedule.weight):
        out = method(t)
        assert out.dtype == dtype and out.shape == t.shape
        torch.testing.assert_close(out[1, 2], method(t[1, 2].reshape(1))[0])


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="unknown schedule 'geometric'.*cosine"):
        make_schedule("geometric")
    with pytest.raises(ValueError, match="power"):
        make_schedule("polynomial", power=0.5)
    with pytest.raises(ValueError, match="endpoint_eps"):
        make_schedule("linear", endpoint_eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        make_schedule("loglinear", eps=1.5)
    with pytest.raises(ValueError, match=r"^schedule 'cosine' has no argument 'power'; it takes endpoint_eps$"):
        make_schedule("cosine", power=2)
    schedule = make_schedule("linear")
    with pytest.raises(ValueError, match=r"t must lie in \[0, 1\]"):
        schedule.alpha(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="t must be a floating-point tensor"):
        schedule.weight(torch.tensor([0, 1]))

"""GenMD4 (a learned schedule per token value) checked against the exact oracle.

The oracle (``tests.support.oracle``) builds the forward process from explicit per-position matrices
and computes, by brute force over all 4^3 noisy sequences, the exact posterior, the exact
continuous bound (Gauss-Legendre in t), the exact T-step bound and the exact law of the
T-step sampler; the process implements the closed forms of ``model.learned``.
"""

import math
from dataclasses import replace

import pytest
import torch

from model import AbsorbingDiffusion, LearnedDiffusion, LearnedSchedule, make_schedule
from model.learned import exponent_spread, learned_schedule_arguments
from model.sampling import SamplingPlan
from model.schedules import DEFAULT_ENDPOINT_EPS, PolynomialSchedule
from tests.support.stats import chi_square_limit, chi_square_statistic, total_variation, z_scores

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH = 3, 3
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
# Unequal exponents, so the per-value terms matter; all >= 1, where the one-sample
# estimator has finite variance (below 1/2 it has none: the weights grow like t^(w-1)/eps).
EXPONENTS = (1.0, 2.5, 5.0)
Z_LIMIT = 4.0  # |estimate - truth| / standard error; fixed seeds, so no flakes


def learned(exponents=EXPONENTS, *, endpoint_eps=DEFAULT_ENDPOINT_EPS, draws=2) -> LearnedDiffusion:
    schedule = LearnedSchedule(VOCAB, endpoint_eps=endpoint_eps)
    with torch.no_grad():  # theta = softplus^-1(w)
        schedule.theta.copy_(torch.tensor(exponents, dtype=torch.float64).expm1().log())
    return LearnedDiffusion(schedule, VOCAB, draws=draws)


@pytest.fixture(scope="module")
def sequences(oracle):
    """Five distinct sequences, likely and unlikely."""
    return oracle.sequences[oracle.probs.argsort(descending=True)[[0, 1, 5, 12, 20]]]


# ---------------------------------------------------------------- schedule and forward process
def test_schedule_is_a_guarded_polynomial_per_token_value():
    schedule = learned().schedule
    torch.testing.assert_close(schedule.exponents(), torch.tensor(EXPONENTS, dtype=torch.float64))
    t = torch.tensor([0.0, 1e-3, 0.3, 0.7, 1.0], dtype=torch.float64)
    close = dict(rtol=1e-5, atol=0)  # theta is float32: w to 1e-7, t^w to 1e-7 w |log t|
    for v, power in enumerate(EXPONENTS):
        reference = PolynomialSchedule(power)  # the same guard, one exponent
        torch.testing.assert_close(schedule.alpha(t)[:, v], reference.alpha(t), **close)
        torch.testing.assert_close(schedule.masking_rate(t)[:, v], reference.masking_rate(t), **close)
        torch.testing.assert_close(schedule.weight(t[1:])[:, v], reference.weight(t[1:]), **close)
    eps = DEFAULT_ENDPOINT_EPS  # alpha(0) and alpha(1) do not depend on the exponent
    ends = torch.tensor([[1 - eps] * 3, [eps] * 3], dtype=torch.float64)
    torch.testing.assert_close(schedule.alpha(t[[0, -1]]), ends)
    schedule.alpha(t).sum().backward()  # t = 0 included: no 0 * log 0 in the gradient
    assert bool(torch.isfinite(schedule.theta.grad).all()) and bool((schedule.theta.grad != 0).all())
    assert LearnedSchedule(VOCAB).exponents().tolist() == pytest.approx([1.0] * 3)  # MD4's start


def test_exponents_can_start_at_a_linear_or_polynomial_schedule():
    """learned_schedule_arguments: every w_v where the named schedule is, with its guard."""
    t = torch.tensor([0.0, 0.1, 0.5, 1.0], dtype=torch.float64)
    for start, exponent in ((make_schedule("linear", endpoint_eps=1e-3), 1.0), (PolynomialSchedule(2.5), 2.5)):
        arguments = learned_schedule_arguments(start)
        assert arguments == {"initial_exponent": exponent, "endpoint_eps": start.endpoint_eps}
        schedule = LearnedSchedule(VOCAB, **arguments)
        for v in range(VOCAB):
            torch.testing.assert_close(schedule.alpha(t)[:, v].detach(), start.alpha(t), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="starts from a linear or polynomial schedule"):
        learned_schedule_arguments(make_schedule("cosine"))


def test_exponent_spread_orders_token_values_by_when_they_unmask():
    spread = exponent_spread(torch.tensor([1.0, 3.0, 0.5, 2.0]), count=2)
    assert (spread.minimum, spread.median, spread.maximum) == (0.5, 1.5, 3.0)
    assert spread.first == ((1, 3.0), (3, 2.0)) and spread.last == ((2, 0.5), (0, 1.0))
    assert len(exponent_spread(torch.ones(3), count=10).first) == 3
    # The claim behind "first": from t to s the larger exponent leaves fewer positions masked.
    schedule = learned((1.0, 2.5, 5.0)).schedule
    stay = (schedule.masking_rate(torch.tensor([0.6], dtype=torch.float64))
            / schedule.masking_rate(torch.tensor([0.9], dtype=torch.float64)))[0]
    assert bool((stay.diff() < 0).all())


def test_corrupt_masks_each_token_value_at_its_own_rate():
    process = learned()
    x0 = torch.arange(VOCAB).repeat_interleave(20_000)[None]
    t = torch.tensor([0.6], dtype=torch.float64)
    padding = torch.rand(x0.shape, generator=torch.Generator().manual_seed(1)) < 0.1
    z = process.corrupt(x0, t, torch.Generator().manual_seed(0), positions=~padding)
    masked = z == process.mask_id
    assert bool((z[~masked] == x0[~masked]).all()) and not bool(masked[padding].any())
    rate = process.schedule.masking_rate(t)[0].detach()
    for v in range(VOCAB):
        real = (x0 == v) & ~padding
        observed = masked[real].double().mean()
        assert abs(float(observed - rate[v])) < 4 * math.sqrt(float(rate[v] * (1 - rate[v])) / int(real.sum()))


def test_equal_exponents_give_md4():
    """With one exponent the per-value terms cancel: the same numbers as AbsorbingDiffusion."""
    genmd4, md4 = learned((2.0,) * VOCAB, draws=1), AbsorbingDiffusion(PolynomialSchedule(2.0), VOCAB)
    x0 = torch.randint(0, VOCAB, (64, 5), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(64, 5, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    denoiser = lambda z, t: logits  # noqa: E731
    for bound in (lambda p: p.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(2)),
                  lambda p: p.nelbo_discrete(denoiser, x0, 3, generator=torch.Generator().manual_seed(2))):
        torch.testing.assert_close(bound(genmd4).detach(), bound(md4), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- exact posterior and bounds
def test_exact_posterior_weighs_completions_by_their_masking_rates(oracle):
    process = learned()
    mask = process.mask_id
    z = torch.tensor([[mask, 1, mask]])
    t = torch.tensor([0.4], dtype=torch.float64)
    masking = process.schedule.masking_rate(t)[0].detach()
    fits = oracle.sequences[:, 1] == 1
    weight = oracle.probs * fits * masking[oracle.sequences[:, 0]] * masking[oracle.sequences[:, 2]]
    for position in (0, 2):
        by_hand = torch.zeros(VOCAB, dtype=torch.float64).index_add_(0, oracle.sequences[:, position], weight)
        exact = oracle.exact_denoiser(process)(z, t)[0, position].exp()
        torch.testing.assert_close(exact, by_hand / by_hand.sum())
        plain = oracle.conditional_logits(z)[0, position].exp()  # ignores which tokens mask sooner
        assert total_variation(exact, plain) > 0.02
    # Masking alike (AbsorbingDiffusion), the exact posterior is the plain conditional.
    md4 = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    torch.testing.assert_close(oracle.exact_denoiser(md4)(z, t), oracle.conditional_logits(z))


def test_exact_unguarded_bound_is_minus_log_likelihood(oracle):
    """With the exact (t-dependent) posterior the continuous bound is -log p(x) for every x,
    exponents below 1 included; the plain conditionals are not the optimal denoiser here."""
    process = learned((0.5, 1.5, 4.0), endpoint_eps=1e-12)
    minus_log_p = -oracle.log_prob(oracle.sequences)
    torch.testing.assert_close(oracle.exact_process_nelbo(oracle.sequences, process), minus_log_p,
                               rtol=0, atol=1e-6)
    plain = oracle.exact_process_nelbo(oracle.sequences, process, oracle)
    assert float((oracle.probs * (plain - minus_log_p)).sum()) > 0.05


def test_monte_carlo_bound_matches_the_exact_bound_and_minus_log_likelihood(oracle, sequences):
    process = learned()
    repeats = 20_000
    with torch.no_grad():
        estimates = process.nelbo(oracle.exact_denoiser(process), sequences.repeat(repeats, 1),
                                  generator=torch.Generator().manual_seed(1)).view(repeats, -1)
    exact = oracle.exact_process_nelbo(sequences, process)
    minus_log_p = -oracle.log_prob(sequences)
    endpoint_scale = LENGTH * 2 * DEFAULT_ENDPOINT_EPS * math.log(VOCAB)
    assert (exact - minus_log_p).abs().max() < endpoint_scale
    assert z_scores(estimates, exact).max() < Z_LIMIT
    assert z_scores(estimates, minus_log_p).max() < Z_LIMIT


def test_discrete_bound_is_looser_and_tightens_with_steps(oracle, sequences):
    process = learned()
    continuous = float((oracle.probs * oracle.exact_process_nelbo(oracle.sequences, process)).sum())
    assert continuous == pytest.approx(oracle.entropy(), abs=1e-3)
    # Over x ~ p, E[NELBO_T] >= E[-log p_T(x)] >= H(p) (per x it need not exceed -log p(x)).
    averaged = [float((oracle.probs * oracle.exact_process_nelbo_discrete(oracle.sequences, process, steps)).sum())
                for steps in (1, 2, 4, 16, 64, 256)]
    assert all(value > continuous for value in averaged)
    assert all(a > b for a, b in zip(averaged, averaged[1:]))
    assert averaged[-1] - continuous < 0.01 < averaged[0] - continuous
    repeats = 10_000  # the Monte Carlo estimator is unbiased for the exact T-step bound
    for steps in (2, 8):
        with torch.no_grad():
            estimates = process.nelbo_discrete(oracle.exact_denoiser(process), sequences.repeat(repeats, 1), steps,
                                               generator=torch.Generator().manual_seed(steps))
        exact = oracle.exact_process_nelbo_discrete(sequences, process, steps)
        assert z_scores(estimates.view(repeats, -1), exact).max() < Z_LIMIT


# ---------------------------------------------------------------- gradient w.r.t. theta
@pytest.mark.parametrize("draws", [2, 1])
def test_theta_gradient_is_unbiased(oracle, draws):
    """Averaged surrogate gradients match finite differences of the exact bound as a function
    of theta, the denoiser held fixed (the plain conditionals, not optimal here, so the
    gradient is far from 0). draws=2 is MD4's leave-one-out baseline; draws=1 has none."""
    x = oracle.sequences[oracle.probs.argsort(descending=True)[[0, 5, 12]]]
    base = learned(draws=draws)
    step = 1e-4
    finite_differences = []
    for v in range(VOCAB):
        shifted = [learned(draws=draws) for _ in range(2)]
        with torch.no_grad():
            shifted[0].schedule.theta[v] += step
            shifted[1].schedule.theta[v] -= step
        up, down = (oracle.exact_process_nelbo(x, p, oracle).sum() for p in shifted)
        finite_differences.append(float(up - down) / (2 * step))
    groups, rows = 40, 600
    generator = torch.Generator().manual_seed(3)
    gradients = []
    for _ in range(groups):
        value = base.nelbo(oracle, x.repeat(rows, 1), generator=generator, reconstruction="uniform").sum() / rows
        gradients.append(torch.autograd.grad(value, base.schedule.theta)[0].double())
    assert z_scores(torch.stack(gradients), torch.tensor(finite_differences, dtype=torch.float64)).max() < Z_LIMIT


def test_a_bound_of_some_positions_reaches_theta():
    """With scored positions (padding never masked, never scored) the surrogate still carries
    theta's gradient."""
    process = learned()
    x0 = torch.tensor([[0, 1, 2], [2, 2, 1]])
    positions = torch.tensor([[True, True, False], [True, True, True]])
    denoiser = lambda z, t: torch.zeros(*z.shape, VOCAB)  # noqa: E731 (uniform prediction)
    t = torch.tensor([0.4, 0.8], dtype=torch.float64)
    value = process.nelbo(denoiser, x0, t, torch.Generator().manual_seed(0), positions=positions).sum()
    (gradient,) = torch.autograd.grad(value, process.schedule.theta)
    assert bool(torch.isfinite(gradient).all()) and bool((gradient != 0).any())


def test_surrogate_value_is_the_average_of_the_draws(oracle, sequences):
    """The score term adds gradient, not value: draws=2 averages two draws' estimates."""
    x0 = sequences.repeat(2, 1)
    t = torch.full((10,), 0.35, dtype=torch.float64)
    pair = learned(draws=2).nelbo_terms(oracle, x0, t, torch.Generator().manual_seed(5))
    singles = learned(draws=1).nelbo_terms(oracle, x0.repeat_interleave(2, 0), t.repeat_interleave(2),
                                           torch.Generator().manual_seed(5))
    torch.testing.assert_close(pair.diffusion.detach(), singles.diffusion.detach().view(-1, 2).mean(1))
    torch.testing.assert_close(pair.num_masked, singles.num_masked.double().view(-1, 2).mean(1))


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("grid", ["uniform", "cosine"])
def test_sampler_follows_its_exact_law_which_tends_to_p(oracle, grid):
    process = learned()
    denoiser = oracle.exact_denoiser(process)
    laws = [oracle.sampler_law(process, denoiser, steps, grid) for steps in (1, 4, 16, 64, 256)]
    distances = [total_variation(law, oracle.probs) for law in laws]
    assert all(a > b for a, b in zip(distances, distances[1:])) and distances[-1] < 0.005
    num, steps = 20_000, 32
    with torch.no_grad():
        samples, _ = process.sample(denoiser, SamplingPlan(steps=steps, grid=grid), num_samples=num, seq_len=LENGTH,
                                    generator=torch.Generator().manual_seed(0))
    law = oracle.sampler_law(process, denoiser, steps, grid)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)


def test_prompt_is_kept_and_conditioning_is_exact(oracle):
    process = learned()
    denoiser = oracle.exact_denoiser(process)
    prompt = torch.tensor([2, process.generate_id, process.generate_id])
    fits = oracle.sequences[:, 0] == 2
    conditional = oracle.probs * fits / (oracle.probs * fits).sum()
    assert total_variation(oracle.sampler_law(process, denoiser, 256, prompt=prompt), conditional) < 0.005
    num, steps = 5_000, 16
    with torch.no_grad():
        samples, _ = process.sample(denoiser, SamplingPlan(steps=steps), num_samples=num, seq_len=LENGTH,
                                    prompt=prompt, generator=torch.Generator().manual_seed(1))
    assert bool((samples[:, 0] == 2).all())
    law = oracle.sampler_law(process, denoiser, steps, prompt=prompt)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(int((law > 0).sum()) - 1)


def test_cache_reuses_only_outputs_of_a_time_independent_denoiser(oracle):
    process = learned()
    plan, kwargs = SamplingPlan(steps=100), dict(num_samples=200, seq_len=LENGTH)
    cached, cached_stats = process.sample(oracle, plan, **kwargs)
    plain, plain_stats = process.sample(oracle, replace(plan, cache=False), **kwargs)
    assert torch.equal(cached, plain)
    assert cached_stats.rows_evaluated <= 200 * (LENGTH + 1) < plain_stats.rows_evaluated
    timed = oracle.exact_denoiser(process)  # depends on t: evaluated at every step with a mask left
    _, timed_stats = process.sample(timed, plan, **kwargs)
    assert timed_stats.rows_evaluated > 200 * (LENGTH + 1)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("make,match", [
    (lambda: LearnedSchedule(VOCAB, initial_exponent=0.0), "initial_exponent must be > 0"),
    (lambda: LearnedSchedule(VOCAB, endpoint_eps=0.0), "endpoint_eps"),
    (lambda: LearnedDiffusion(LearnedSchedule(4), VOCAB), "schedule has 4 exponents for vocab_size=3"),
    (lambda: LearnedDiffusion(LearnedSchedule(VOCAB), VOCAB, draws=0), "draws must be an int >= 1"),
    (lambda: LearnedDiffusion(make_schedule("linear"), VOCAB),
     "schedule must be a model.learned.LearnedSchedule"),
])
def test_bad_construction_raises_value_error_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()

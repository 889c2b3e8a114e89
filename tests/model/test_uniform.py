"""D3PM's uniform diffusion checked against the exact oracle (``tests.support.oracle``): the exact
posterior, the exact continuous and T-step bounds and the exact law of the T-step sampler,
all computed by brute force from explicit per-position matrices."""

import math
from dataclasses import replace

import pytest
import torch

from model import UniformDiffusion, make_schedule
from model.denoiser import FunctionDenoiser
from model.sampling import SamplingPlan
from model.schedules import DEFAULT_ENDPOINT_EPS
from tests.support.stats import chi_square_limit, chi_square_statistic, total_variation, z_scores

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH = 3, 3
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
SCHEDULES = [("linear", {}), ("cosine", {})]
Z_LIMIT = 4.0  # |estimate - truth| / standard error; fixed seeds, so no flakes


@pytest.fixture(scope="module")
def sequences(oracle):
    """Five distinct sequences, likely and unlikely."""
    return oracle.sequences[oracle.probs.argsort(descending=True)[[0, 1, 5, 12, 20]]]


def test_corrupt_keeps_or_draws_a_uniform_token():
    process = UniformDiffusion(make_schedule("linear"), VOCAB)
    x0 = torch.zeros(1, 60_000, dtype=torch.long)
    t = torch.tensor([0.6], dtype=torch.float64)
    padding = torch.rand(x0.shape, generator=torch.Generator().manual_seed(1)) < 0.1
    z = process.corrupt(x0, t, torch.Generator().manual_seed(0), positions=~padding)
    assert bool((z[padding] == 0).all()) and int(z.max()) < VOCAB  # no mask token
    alpha = float(process.schedule.alpha(t))
    expected = torch.tensor([alpha + (1 - alpha) / VOCAB] + [(1 - alpha) / VOCAB] * (VOCAB - 1), dtype=torch.float64)
    real = z[~padding]
    observed = torch.bincount(real, minlength=VOCAB).double() / real.numel()
    standard_error = (expected * (1 - expected) / real.numel()).sqrt()
    assert bool(((observed - expected).abs() < 4 * standard_error).all())


def test_exact_posterior_is_bayes_with_the_uniform_channel(oracle):
    process = UniformDiffusion(make_schedule("cosine"), VOCAB)
    z, t = torch.tensor([[2, 0, 1]]), torch.tensor([0.55], dtype=torch.float64)
    alpha = float(process.schedule.alpha(t))
    channel = (alpha * (oracle.sequences == z) + (1 - alpha) / VOCAB).prod(-1)     # prod_n q(z_n | x_n)
    weight = oracle.probs * channel
    for position in range(LENGTH):
        by_hand = torch.zeros(VOCAB, dtype=torch.float64).index_add_(0, oracle.sequences[:, position], weight)
        torch.testing.assert_close(oracle.exact_denoiser(process)(z, t)[0, position].exp(), by_hand / by_hand.sum())


@pytest.mark.parametrize("name,kwargs", SCHEDULES)
def test_exact_unguarded_bound_is_minus_log_likelihood(oracle, name, kwargs):
    process = UniformDiffusion(make_schedule(name, endpoint_eps=1e-12, **kwargs), VOCAB)
    torch.testing.assert_close(oracle.exact_process_nelbo(oracle.sequences, process),
                               -oracle.log_prob(oracle.sequences), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,kwargs", SCHEDULES)
def test_monte_carlo_bound_matches_the_exact_bound_and_minus_log_likelihood(oracle, sequences, name, kwargs):
    process = UniformDiffusion(make_schedule(name, **kwargs), VOCAB)
    repeats = 20_000
    estimates = process.nelbo(oracle.exact_denoiser(process), sequences.repeat(repeats, 1),
                              generator=torch.Generator().manual_seed(1)).view(repeats, -1)
    exact = oracle.exact_process_nelbo(sequences, process)
    minus_log_p = -oracle.log_prob(sequences)
    # Endpoint terms: reconstruction about L eps (log(V / eps) + 1) at most, prior ~ L V eps^2.
    eps = DEFAULT_ENDPOINT_EPS
    assert (exact - minus_log_p).abs().max() < LENGTH * eps * (math.log(VOCAB / eps) + 1)
    assert z_scores(estimates, exact).max() < Z_LIMIT
    assert z_scores(estimates, minus_log_p).max() < Z_LIMIT


def test_discrete_bound_is_looser_and_tightens_with_steps(oracle, sequences):
    process = UniformDiffusion(make_schedule("linear"), VOCAB)
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
        estimates = process.nelbo_discrete(oracle.exact_denoiser(process), sequences.repeat(repeats, 1), steps,
                                           generator=torch.Generator().manual_seed(steps))
        exact = oracle.exact_process_nelbo_discrete(sequences, process, steps)
        assert z_scores(estimates.view(repeats, -1), exact).max() < Z_LIMIT


def test_endpoint_terms(oracle, sequences):
    """The prior term is KL(q(z_1 | x) || Uniform(V)); "uniform" reconstruction is the exact
    expectation of the decoder p(x | z_0) = q(z_0 | x), which "model" estimates with it."""
    # Wide ends so both terms are large: alpha(0) = 0.95, alpha(1) about 0.3.
    process = UniformDiffusion(make_schedule("loglinear", eps=0.3, endpoint_eps=0.05), VOCAB)
    channel_zero, channel_one = (alpha * torch.eye(VOCAB, dtype=torch.float64) + (1 - alpha) / VOCAB  # q_t(z | v)
                                 for alpha in process.schedule.alpha(torch.tensor([0.0, 1.0], dtype=torch.float64)))
    q_zero, q_one = channel_zero[0], channel_one[0]                         # q(. | x = 0) at t = 0 and 1
    repeats = 20_000
    x0 = sequences.repeat(repeats, 1)
    channel = lambda z, t: channel_zero[z].log()  # noqa: E731  (symmetric: row z is q(z | v) over v)
    model = process.nelbo_terms(channel, x0, generator=torch.Generator().manual_seed(4))
    uniform = process.nelbo_terms(channel, x0, generator=torch.Generator().manual_seed(4), reconstruction="uniform")
    prior = LENGTH * float((q_one * (VOCAB * q_one).log()).sum())         # L KL(q(z_1 | x) || Uniform)
    torch.testing.assert_close(model.prior, torch.full_like(model.prior, prior))
    entropy = -float((q_zero * q_zero.log()).sum())
    torch.testing.assert_close(uniform.reconstruction, torch.full_like(uniform.reconstruction, LENGTH * entropy))
    assert z_scores(model.reconstruction[:, None], uniform.reconstruction[:1]).item() < Z_LIMIT


@pytest.mark.parametrize("name,grid", [("linear", "uniform"), ("linear", "cosine"), ("cosine", "uniform")])
def test_sampler_follows_its_exact_law_which_tends_to_p(oracle, name, grid):
    process = UniformDiffusion(make_schedule(name), VOCAB)
    denoiser = oracle.exact_denoiser(process)
    laws = [oracle.sampler_law(process, denoiser, steps, grid) for steps in (1, 4, 16, 64, 256)]
    distances = [total_variation(law, oracle.probs) for law in laws]
    assert all(a > b for a, b in zip(distances, distances[1:])) and distances[-1] < 0.01
    num, steps = 20_000, 32
    samples, _ = process.sample(denoiser, SamplingPlan(steps=steps, grid=grid), num_samples=num, seq_len=LENGTH,
                                generator=torch.Generator().manual_seed(0))
    law = oracle.sampler_law(process, denoiser, steps, grid)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)


def test_last_step_draws_from_the_prediction(oracle):
    """With a wide guard (alpha(0) = 0.75) the last step's rule matters: the sampler draws the
    clean tokens from mu, as if alpha(0) = 1, and its samples follow that law."""
    process = UniformDiffusion(make_schedule("linear", endpoint_eps=0.25), VOCAB)
    denoiser = oracle.exact_denoiser(process)
    num, steps = 20_000, 4
    samples, _ = process.sample(denoiser, SamplingPlan(steps=steps), num_samples=num, seq_len=LENGTH,
                                generator=torch.Generator().manual_seed(5))
    law = oracle.sampler_law(process, denoiser, steps)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)


def test_prompt_tokens_are_kept_and_condition_exactly_when_the_denoiser_knows_them(oracle):
    """The kept tokens never change. A denoiser told which tokens are clean gives exact
    conditioning; the plain posterior, which takes them for noisy, does not."""
    process = UniformDiffusion(make_schedule("linear"), VOCAB)
    prompt = torch.tensor([process.generate_id, 1, process.generate_id])
    informed = oracle.exact_denoiser(process, known=prompt != process.generate_id)
    num, steps = 5_000, 16
    samples, _ = process.sample(informed, SamplingPlan(steps=steps), num_samples=num, seq_len=LENGTH, prompt=prompt,
                                generator=torch.Generator().manual_seed(1))
    assert bool((samples[:, 1] == 1).all())
    law = oracle.sampler_law(process, informed, steps, prompt=prompt)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(int((law > 0).sum()) - 1)
    fits = oracle.sequences[:, 1] == 1
    conditional = oracle.probs * fits / (oracle.probs * fits).sum()
    assert total_variation(oracle.sampler_law(process, informed, 256, prompt=prompt), conditional) < 0.01
    uninformed = oracle.sampler_law(process, oracle.exact_denoiser(process), 256, prompt=prompt)
    assert total_variation(uninformed, conditional) > 0.03


def test_cache_reuses_only_outputs_of_a_time_independent_denoiser(oracle):
    process = UniformDiffusion(make_schedule("linear"), VOCAB)
    frozen = oracle.exact_denoiser(process)
    fixed_time = FunctionDenoiser(lambda z, t: frozen(z, torch.full_like(t, 0.5)), time_independent=True)
    plan, kwargs = SamplingPlan(steps=100), dict(num_samples=200, seq_len=LENGTH)
    cached, cached_stats = process.sample(fixed_time, plan, **kwargs)
    plain, plain_stats = process.sample(fixed_time, replace(plan, cache=False), **kwargs)
    assert torch.equal(cached, plain)
    assert cached_stats.rows_evaluated < plain_stats.rows_evaluated == 100 * 200
    _, timed_stats = process.sample(frozen, plan, **kwargs)
    assert timed_stats.rows_evaluated == 100 * 200  # t matters: every step calls the network

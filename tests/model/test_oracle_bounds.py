"""The exact-conditionals identity (docs/math.md), checked with the exact conditionals of a small distribution.

With the optimal denoiser the continuous NELBO equals -log p(x) (up to the endpoint terms,
O(L * eps * log V)); the Monte Carlo estimator must agree within its standard error; the
discrete-time bound is looser and tightens as T grows; ancestral sampling reproduces p.
"""

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan
from model.schedules import make_schedule
from tests.support.oracle import EnumerableDistribution

VOCAB, LENGTH = 3, 4
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
SCHEDULES = [("linear", {}), ("cosine", {}), ("polynomial", {"power": 2.0}), ("loglinear", {})]
Z_LIMIT = 4.0  # |estimate - truth| / standard error; deterministic seeds, so no flakes


@pytest.fixture(scope="module")
def sequences(oracle):
    """Five distinct sequences: likely and unlikely ones."""
    order = oracle.probs.argsort(descending=True)
    return oracle.sequences[order[[0, 1, 10, 40, 80]]]


def _z_scores(samples: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    standard_error = samples.std(0) / math.sqrt(samples.shape[0])
    return (samples.mean(0) - truth).abs() / standard_error


def test_oracle_is_exact(oracle, sequences):
    """The denoiser is the true conditional: check one case by hand."""
    z = sequences.clone()
    z[:, 1] = VOCAB  # mask position 1
    logits = oracle.conditional_logits(z)
    for row, x in enumerate(sequences):
        match = (oracle.sequences[:, [0, 2, 3]] == x[[0, 2, 3]]).all(-1)
        joint = torch.zeros(VOCAB, dtype=torch.float64).index_add_(
            0, oracle.sequences[match, 1], oracle.probs[match])
        torch.testing.assert_close(logits[row, 1].exp(), joint / joint.sum())


def test_exact_unguarded_nelbo_is_minus_log_likelihood(oracle):
    """Beta-function identity: masked diffusion = average over AR orders."""
    for name, kwargs in SCHEDULES:
        schedule = make_schedule(name, endpoint_eps=1e-12, **kwargs)
        if name == "loglinear":  # alpha(1) = eps > 0: a prior term of L * eps * log V
            continue
        torch.testing.assert_close(oracle.exact_nelbo(oracle.sequences, schedule),
                                   -oracle.log_prob(oracle.sequences), rtol=0, atol=1e-9)


@pytest.mark.parametrize("name,kwargs", SCHEDULES)
def test_monte_carlo_nelbo_matches_minus_log_likelihood(oracle, sequences, name, kwargs):
    schedule = make_schedule(name, **kwargs)
    diffusion = AbsorbingDiffusion(schedule, VOCAB)
    repeats = 20_000
    batch = sequences.repeat(repeats, 1)  # tiled: every x sees the whole time interval
    estimates = diffusion.nelbo(oracle, batch, generator=torch.Generator().manual_seed(1))
    estimates = estimates.view(repeats, len(sequences))
    exact = oracle.exact_nelbo(sequences, schedule)
    minus_log_p = -oracle.log_prob(sequences)
    # The endpoint terms keep the exact guarded bound within L * eps * log V of -log p(x).
    alpha = schedule.alpha(torch.tensor([0.0, 1.0], dtype=torch.float64))
    endpoint_scale = LENGTH * float(1 - alpha[0] + alpha[1]) * math.log(VOCAB)
    assert (exact - minus_log_p).abs().max() < endpoint_scale
    assert _z_scores(estimates, exact).max() < Z_LIMIT
    assert _z_scores(estimates, minus_log_p).max() < Z_LIMIT


def test_low_discrepancy_times_lower_the_variance(oracle, sequences):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    batch = sequences[:1].repeat(4096, 1)
    generator = torch.Generator().manual_seed(2)
    stratified = [diffusion.nelbo(oracle, batch, generator=generator).mean() for _ in range(40)]
    iid = [diffusion.nelbo(oracle, batch, t=torch.rand(4096, generator=generator, dtype=torch.float64),
                           generator=generator).mean() for _ in range(40)]
    assert torch.stack(stratified).var() < 0.5 * torch.stack(iid).var()


@pytest.mark.parametrize("name,kwargs", SCHEDULES[:3])
def test_discrete_bound_is_looser_and_tightens_with_steps(oracle, sequences, name, kwargs):
    schedule = make_schedule(name, **kwargs)
    diffusion = AbsorbingDiffusion(schedule, VOCAB)
    entropy = oracle.entropy()
    data_averaged = []
    for steps in (1, 2, 4, 8, 16, 64, 256):
        exact = oracle.exact_nelbo_discrete(oracle.sequences, schedule, steps)
        data_averaged.append(float((oracle.probs * exact).sum()))
    # Over x ~ p, E[NELBO_T] >= E[-log p_T(x)] >= H(p); it decreases to the continuous bound.
    # (Per x it need not exceed -log p(x): the T-step model can put more mass on some x.)
    continuous = float((oracle.probs * oracle.exact_nelbo(oracle.sequences, schedule)).sum())
    assert continuous == pytest.approx(entropy, abs=1e-3)
    assert all(value > continuous for value in data_averaged)
    assert all(a > b for a, b in zip(data_averaged, data_averaged[1:]))
    assert data_averaged[-1] - continuous < 0.02 < data_averaged[0] - continuous
    # The Monte Carlo estimator is unbiased for the exact discrete bound.
    repeats = 10_000
    for steps in (2, 8):
        estimates = diffusion.nelbo_discrete(oracle, sequences.repeat(repeats, 1), steps,
                                             generator=torch.Generator().manual_seed(steps))
        exact = oracle.exact_nelbo_discrete(sequences, schedule, steps)
        assert _z_scores(estimates.view(repeats, -1), exact).max() < Z_LIMIT


def _total_variation(samples: torch.Tensor, oracle: EnumerableDistribution) -> float:
    counts = torch.bincount(oracle.index_of(samples), minlength=len(oracle.probs))
    return 0.5 * float((counts / counts.sum() - oracle.probs).abs().sum())


@pytest.mark.parametrize("name,grid", [("linear", "uniform"), ("cosine", "cosine"), ("polynomial", "uniform")])
def test_ancestral_sampling_reproduces_the_distribution(oracle, name, grid):
    kwargs = {"power": 2.0} if name == "polynomial" else {}
    diffusion = AbsorbingDiffusion(make_schedule(name, **kwargs), VOCAB)
    num = 20_000
    generator = torch.Generator().manual_seed(3)
    samples, _ = diffusion.sample(oracle, SamplingPlan(steps=100, grid=grid), num_samples=num, seq_len=LENGTH,
                                  generator=generator)
    reference = _total_variation(oracle.sample(num, generator), oracle)  # pure sampling noise
    assert _total_variation(samples, oracle) < 1.5 * reference + 0.01
    # The test can tell a wrong sampler: one step unmasks all at once from the marginals.
    one_step, _ = diffusion.sample(oracle, SamplingPlan(steps=1), num_samples=num, seq_len=LENGTH, generator=generator)
    assert _total_variation(one_step, oracle) > 3 * reference

"""The first-hitting sampler: its exact law (chi-square against the oracle's), the law of its
event times, one network call per token, the k-per-call budget, and that it is the limit of
ancestral sampling."""

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan
from model.schedules import make_schedule
from tests.support.denoisers import TableDenoiser
from tests.support.stats import chi_square_limit, chi_square_statistic, total_variation

VOCAB, LENGTH = 3, 4
EXACT = SamplingPlan(sampler="first-hitting")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_samples_follow_the_exact_law_of_an_arbitrary_denoiser(oracle, name):
    """A wide guard (r(0) = 0.1) makes the final fill matter; the table denoiser is no
    distribution's conditionals, so the law is not p and only the sampler's own law fits."""
    diffusion = AbsorbingDiffusion(make_schedule(name, endpoint_eps=0.1), VOCAB)
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=1)
    samples, _ = diffusion.sample(denoiser, EXACT, num_samples=20_000, seq_len=LENGTH,
                                  generator=torch.Generator().manual_seed(0))
    law = oracle.first_hitting_law(diffusion, denoiser)
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)
    without_fill = oracle.first_hitting_law(AbsorbingDiffusion(make_schedule(name), VOCAB), denoiser)
    assert chi_square_statistic(samples, without_fill, oracle) > chi_square_limit(len(law) - 1)


def test_with_the_exact_conditionals_it_draws_from_the_data_and_conditions_exactly(oracle):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    assert total_variation(oracle.first_hitting_law(diffusion, oracle), oracle.probs) < 1e-3  # only the guard
    prompt = torch.tensor([VOCAB, 1, VOCAB, VOCAB])
    fits = oracle.sequences[:, 1] == 1
    conditional = oracle.probs * fits / (oracle.probs * fits).sum()
    law = oracle.first_hitting_law(diffusion, oracle, prompt=prompt)
    assert total_variation(law, conditional) < 1e-3
    samples, stats = diffusion.sample(oracle, EXACT, num_samples=5_000, seq_len=LENGTH, prompt=prompt,
                                      generator=torch.Generator().manual_seed(1))
    assert bool((samples[:, 1] == 1).all())
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(int((law > 0).sum()) - 1)
    assert stats.network_calls <= 3 and all(calls <= 3 for calls in stats.row_calls)  # one per generated token


def test_event_times_follow_the_first_hitting_law():
    """From n masks at time t the next event solves r(tau) = r(t) U^(1/n): the statistics
    W = (r(tau) / r(t))^n of a time-conditioned denoiser's calls are uniform on (0, 1)."""
    schedule = make_schedule("cosine")
    diffusion = AbsorbingDiffusion(schedule, VOCAB)
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=2, time_weight=1.0)
    num = 4_000
    diffusion.sample(denoiser, EXACT, num_samples=num, seq_len=LENGTH, generator=torch.Generator().manual_seed(3))
    calls = [(z, t) for z, t in denoiser.calls]
    assert len(calls) == LENGTH and all(z.shape[0] == num for z, _ in calls)  # no fill: eps = 1e-4
    previous = schedule.masking_rate(torch.ones(num, dtype=torch.float64))
    statistics = []
    for masks, (z, t) in zip(range(LENGTH, 0, -1), calls):
        assert bool(((z == VOCAB).sum(-1) == masks).all())
        rate = schedule.masking_rate(t.to(torch.float64))
        statistics.append((rate / previous) ** masks)
        previous = rate
    w = torch.cat(statistics)
    counts = torch.histc(w, bins=20, min=0.0, max=1.0)
    expected = w.numel() / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < chi_square_limit(19)


def test_samples_with_a_time_conditioned_denoiser_follow_the_limit_of_ancestral_sampling(oracle):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=4, time_weight=3.0)
    samples, _ = diffusion.sample(denoiser, EXACT, num_samples=20_000, seq_len=LENGTH,
                                  generator=torch.Generator().manual_seed(5))
    law = oracle.sampler_law(diffusion, denoiser, 96)  # 96 steps: within 0.5% of the limit
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)
    frozen = TableDenoiser(VOCAB, LENGTH, seed=4)  # the same network read at t = 0 gives another law
    assert chi_square_statistic(samples, oracle.first_hitting_law(diffusion, frozen), oracle) > \
        chi_square_limit(len(law) - 1)


def test_it_is_the_limit_of_ancestral_sampling(oracle):
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.1), VOCAB)
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=6)
    target = oracle.first_hitting_law(diffusion, denoiser)
    distances = [total_variation(oracle.sampler_law(diffusion, denoiser, steps), target) for steps in (4, 16, 64)]
    assert distances[0] > distances[1] > distances[2] and distances[2] < 0.02
    assert distances[1] / distances[2] > 3  # O(1 / steps)


def test_one_call_per_token_and_a_budget_reveals_k_per_call():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    length = 10
    denoiser = lambda z, t: torch.zeros(*z.shape, VOCAB)  # noqa: E731
    _, exact = diffusion.sample(denoiser, EXACT, num_samples=50, seq_len=length)
    assert exact.row_calls == (length,) * 50 and exact.network_calls == length
    _, enough = diffusion.sample(denoiser, SamplingPlan(sampler="first-hitting", steps=64), num_samples=50,
                                 seq_len=length)
    assert enough.row_calls == (length,) * 50
    for steps, calls in ((4, 4), (3, 3), (2, 2), (1, 1)):  # k = ceil(10 / steps) tokens per call
        _, stats = diffusion.sample(denoiser, SamplingPlan(sampler="first-hitting", steps=steps), num_samples=50,
                                    seq_len=length)
        assert stats.row_calls == (calls,) * 50


def test_an_endpoint_hit_fills_every_remaining_mask_in_one_call_at_t0():
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.3), VOCAB)
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=7, time_weight=1.0)
    _, stats = diffusion.sample(denoiser, EXACT, num_samples=2_000, seq_len=LENGTH)
    assert min(stats.row_calls) < LENGTH  # q = r(0) / r(1) = 3/7: most rows end with a fill
    fills = [t for z, t in denoiser.calls if bool((t == 0).any())]
    assert fills and all(bool((t[t > 0] > 0).all()) for t in fills)

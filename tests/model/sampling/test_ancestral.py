"""The ancestral sampler (``model.sampling.ancestral``): its exact law (chi-square against the
oracle's T-step law), exact conditioning, lazy network calls (caching), and the time a
time-conditioned denoiser sees."""

from dataclasses import replace

import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan, time_grid
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.support.denoisers import ConstantDenoiser, TableDenoiser
from tests.support.stats import chi_square_limit, chi_square_statistic


def test_ancestral_samples_follow_the_exact_law_of_their_steps(oracle):
    """Chi-square against the oracle's exact T-step law for an arbitrary network, with a wide
    guard so that the last step's fill matters."""
    diffusion = AbsorbingDiffusion(make_schedule("cosine", endpoint_eps=0.05), 3)
    denoiser, steps = TableDenoiser(3, 4, seed=8), 24
    samples, _ = diffusion.sample(denoiser, SamplingPlan(steps=steps, grid="cosine"), num_samples=10_000, seq_len=4,
                                  generator=torch.Generator().manual_seed(0))  # one generator: 10k rows fast
    law = oracle.sampler_law(diffusion, denoiser, steps, "cosine")
    assert chi_square_statistic(samples, law, oracle) < chi_square_limit(len(law) - 1)
    coarse = oracle.sampler_law(diffusion, denoiser, 4, "cosine")  # the test tells the step count apart
    assert chi_square_statistic(samples, coarse, oracle) > chi_square_limit(len(law) - 1)


def test_conditioning_is_exact(oracle):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 3)
    prompt = torch.tensor([1, 3, 2, 3])
    out, _ = diffusion.sample(oracle, SamplingPlan(steps=20), num_samples=500, seq_len=4, prompt=prompt)
    keep = prompt != 3
    fits = (oracle.sequences[:, keep] == prompt[keep]).all(-1)
    conditional = oracle.probs * fits / (oracle.probs * fits).sum()
    counts = torch.bincount(oracle.index_of(out), minlength=81).double()
    assert 0.5 * float((counts / 500 - conditional).abs().sum()) < 0.1


def test_cache_gives_the_same_samples_with_fewer_calls(oracle):
    diffusion = AbsorbingDiffusion(make_schedule("cosine"), 3)
    plan = SamplingPlan(steps=200, grid="cosine")
    cached, cached_stats = diffusion.sample(oracle, plan, num_samples=64, seq_len=4)
    plain, plain_stats = diffusion.sample(oracle, replace(plan, cache=False), num_samples=64, seq_len=4)
    assert torch.equal(cached, plain)
    assert plain_stats.network_calls == 200 and plain_stats.rows_evaluated == 200 * 64
    assert cached_stats.network_calls < plain_stats.network_calls
    # Each sequence changes at most L times, so it is evaluated at most L times.
    assert cached_stats.rows_evaluated <= 64 * 4 and max(cached_stats.row_calls) <= 4


def test_many_steps_cost_about_seq_len_calls():
    net = Transformer(TransformerConfig(vocab_size=7, n_layers=1, d_model=16, n_heads=2, max_seq_len=12)).eval()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 7)
    with torch.no_grad():
        out, stats = diffusion.sample(net, SamplingPlan(steps=5000), num_samples=1, seq_len=12)
    assert bool((out < 7).all())
    assert stats.steps == 5000 and stats.network_calls <= 12


def test_time_conditioned_denoiser_sees_the_current_time():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 4)
    denoiser = ConstantDenoiser(torch.full((4,), 0.25))
    diffusion.sample(denoiser, SamplingPlan(steps=50), num_samples=3, seq_len=6)
    grid = time_grid(50, "uniform")
    times = [float(t[0]) for t in denoiser.calls]
    assert times == sorted(times, reverse=True)
    assert all(any(abs(t - float(g)) < 1e-12 for g in grid[:-1]) for t in times)

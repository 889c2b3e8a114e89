"""Every sampler through one plan: conditioning, seeds and batch-size independence, the fixed
shape option, semi-autoregressive blocks, the token distribution (temperature, nucleus); and
the ancestral sampler: its exact law, lazy network calls (caching), grids."""

from dataclasses import replace

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import RemaskOptions, SamplingPlan, inverse_cdf, sample_generators, time_grid, top_p_filter
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.conftest import ConstantDenoiser, chi_square_limit, chi_square_statistic
from tests.support.denoisers import ShapeRecorder, TableDenoiser
from tests.support.oracle import EnumerableDistribution

PLANS = {"ancestral": SamplingPlan(steps=12), "first-hitting": SamplingPlan(sampler="first-hitting", steps=None),
         "first-hitting-k2": SamplingPlan(sampler="first-hitting", steps=2),
         "confidence": SamplingPlan(sampler="confidence", steps=3, grid="cosine"),
         "remdm": SamplingPlan(sampler="remdm", steps=12),
         "remdm-loop": SamplingPlan(sampler="remdm", steps=12, options=RemaskOptions(schedule="loop"))}


@pytest.fixture(scope="module")
def diffusion() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), 3)


# ------------------------------------------------------------------ every sampler
@pytest.mark.parametrize("name", PLANS)
def test_prompt_is_kept_and_samples_hold_valid_tokens(oracle, diffusion, name):
    mask = diffusion.mask_id
    prompts = torch.tensor([[2, mask, mask, mask], [mask, mask, mask, 0], [1, mask, 2, mask]]).repeat(20, 1)
    out, stats = diffusion.sample(oracle, PLANS[name], num_samples=60, seq_len=4, prompt=prompts)
    assert out.shape == (60, 4) and out.dtype == torch.long and bool(((out >= 0) & (out < 3)).all())
    keep = prompts != mask
    assert bool((out[keep] == prompts[keep]).all())
    assert stats.network_calls >= 1 and len(stats.row_calls) == 60


@pytest.mark.parametrize("name", PLANS)
def test_a_sample_depends_on_its_seed_and_index_not_on_its_batch(oracle, diffusion, name):
    """Sample i of a seed draws from its own generator: the same in a batch of 6 or of 2 x 3."""
    plan = PLANS[name]
    together, _ = diffusion.sample(oracle, plan, num_samples=6, seq_len=4)
    assert torch.equal(together, diffusion.sample(oracle, plan, num_samples=6, seq_len=4)[0])
    halves = [diffusion.sample(oracle, plan, num_samples=3, seq_len=4, generator=sample_generators(plan.seed, range(first, first + 3)))[0]
              for first in (0, 3)]
    assert torch.equal(together, torch.cat(halves))
    other, _ = diffusion.sample(oracle, replace(plan, seed=1), num_samples=6, seq_len=4)
    assert not torch.equal(together, other)


@pytest.mark.parametrize("name", PLANS)
def test_a_fixed_input_shape_changes_nothing_but_the_rows_passed(oracle, diffusion, name):
    plan = PLANS[name]
    varying, varying_stats = diffusion.sample(oracle, plan, num_samples=8, seq_len=4)
    fixed, fixed_stats = diffusion.sample(oracle, replace(plan, static_shape=True), num_samples=8, seq_len=4)
    assert torch.equal(varying, fixed)
    assert fixed_stats.network_calls == varying_stats.network_calls
    assert fixed_stats.rows_evaluated == 8 * fixed_stats.network_calls >= varying_stats.rows_evaluated
    assert fixed_stats.row_calls == varying_stats.row_calls


@pytest.mark.parametrize("name", PLANS)
def test_blocks_generate_beyond_the_window_with_the_text_before_as_context(name):
    """Sequences of 10 from a network that takes 4 positions, in blocks of 2: every call sees
    at most 4 positions, the context before the block is the final text, and a prompt token
    in a later block is kept."""
    vocab, length, window = 5, 10, 4
    diffusion = AbsorbingDiffusion(make_schedule("linear"), vocab)
    recorder = ShapeRecorder(torch.randn(window, vocab, generator=torch.Generator().manual_seed(0)))
    prompt = torch.full((length,), vocab)
    prompt[0], prompt[7] = 3, 1
    plan = replace(PLANS[name], block_len=2, static_shape=True)  # every call sees all 3 rows
    out, _ = diffusion.sample(recorder, plan, num_samples=3, seq_len=length, prompt=prompt, window=window)
    assert bool((out < vocab).all()) and bool((out[:, 0] == 3).all()) and bool((out[:, 7] == 1).all())
    assert max(z.shape[1] for z in recorder.inputs) == window
    for z in recorder.inputs:  # the window [end - 4, end) of a block [end - 2, end)
        context = z[:, :-2]
        assert not bool((context == vocab).any())
        if context.shape[1]:
            assert any(torch.equal(context, out[:, s:s + 2]) for s in (0, 2, 4, 6))
    with pytest.raises(ValueError, match="seq_len 10 exceeds the network's window of 4"):
        diffusion.sample(recorder, PLANS[name], num_samples=1, seq_len=length, window=window)


# ------------------------------------------------------------------ the token distribution
def test_temperature_sharpens_and_top_p_cuts_the_token_distribution():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 4)
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    plan = SamplingPlan(sampler="first-hitting")
    cold, _ = diffusion.sample(ConstantDenoiser(probs), replace(plan, temperature=0.5), num_samples=400, seq_len=16)
    expected = probs.double() ** 2 / (probs.double() ** 2).sum()
    assert torch.allclose(torch.bincount(cold.flatten(), minlength=4).double() / cold.numel(), expected, atol=0.02)
    nucleus, _ = diffusion.sample(ConstantDenoiser(probs), replace(plan, top_p=0.7), num_samples=400, seq_len=16)
    counts = torch.bincount(nucleus.flatten(), minlength=4).double()
    assert counts[0] == 0 and counts[2] == 0 and abs(float(counts[1] / counts.sum()) - 0.625) < 0.02
    full, _ = diffusion.sample(ConstantDenoiser(probs), plan, num_samples=400, seq_len=16)
    assert abs(float((full == 0).double().mean()) - 0.15) < 0.02


def test_top_p_filter_keeps_the_nucleus():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([[0, 0.625, 0, 0.375]], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([[0, 1.0, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 1.0), probs)


def test_inverse_cdf_resolves_probabilities_float32_cannot():
    tiny = 1e-10  # float32 has no number between 1 - 6e-8 and 1
    probs = torch.tensor([[1 - tiny, tiny], [tiny, 1 - tiny], [0.5, 0.5]], dtype=torch.float64)
    u = torch.tensor([1 - tiny / 2, tiny / 2, 0.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 0, 0]
    zero_first = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    assert inverse_cdf(zero_first, torch.zeros(1, dtype=torch.float64)).tolist() == [1]


def test_time_grids():
    for grid in ("uniform", "cosine"):
        times = time_grid(10, grid)
        assert times[0] == 1.0 and times[-1] == 0.0 and bool((times.diff() < 0).all())
    cosine = time_grid(10, "cosine")
    assert (1 - cosine[1]) < 0.1 < float(cosine[-2])  # short steps near t = 1
    with pytest.raises(ValueError, match="grid"):
        time_grid(10, "log")


# ------------------------------------------------------------------ ancestral sampling
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


def test_a_single_generator_is_still_accepted():
    """One generator for the batch (the old way): reproducible, but tied to the batch."""
    oracle = EnumerableDistribution.random(3, 4, torch.Generator().manual_seed(1))
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 3)
    plan = SamplingPlan(steps=8)
    first, _ = diffusion.sample(oracle, plan, num_samples=5, seq_len=4, generator=torch.Generator().manual_seed(3))
    again, _ = diffusion.sample(oracle, plan, num_samples=5, seq_len=4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again)

"""The ancestral sampler: conditioning, lazy network calls (caching), nucleus, grids."""

import pytest
import torch

from model.diffusion import MaskedDiffusion
from model.sampling import inverse_cdf, time_grid, top_p_filter
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.conftest import ConstantDenoiser


def test_samples_hold_no_mask_and_prompt_tokens_are_kept(oracle):
    diffusion = MaskedDiffusion(make_schedule("linear"), 3)
    mask = diffusion.mask_id
    prompts = {
        "prefix": torch.tensor([2, mask, mask, mask]),
        "suffix": torch.tensor([mask, mask, mask, 0]),
        "infill": torch.tensor([1, mask, 2, mask]),
    }
    for name, prompt in prompts.items():
        out = diffusion.sample(oracle, 500, 4, steps=20, prompt=prompt,
                               generator=torch.Generator().manual_seed(0))
        assert out.shape == (500, 4) and out.dtype == torch.long
        assert bool((out < 3).all()), name
        keep = prompt != mask
        assert bool((out[:, keep] == prompt[keep]).all()), name
        # Conditioning is exact: the generated tokens follow p(x | prompt tokens).
        fits = (oracle.sequences[:, keep] == prompt[keep]).all(-1)
        conditional = oracle.probs * fits
        conditional = conditional / conditional.sum()
        counts = torch.bincount(oracle.index_of(out), minlength=81).double()
        assert 0.5 * float((counts / 500 - conditional).abs().sum()) < 0.1, name


def test_per_sample_prompts(oracle):
    diffusion = MaskedDiffusion(make_schedule("linear"), 3)
    prompt = torch.tensor([[0, 3, 3, 3], [3, 3, 3, 1]])
    out = diffusion.sample(oracle, 2, 4, steps=8, prompt=prompt)
    assert out[0, 0] == 0 and out[1, 3] == 1


def test_cache_gives_the_same_samples_with_fewer_calls(oracle):
    diffusion = MaskedDiffusion(make_schedule("cosine"), 3)
    kwargs = dict(num_samples=64, seq_len=4, steps=200, grid="cosine", return_stats=True)
    cached, cached_stats = diffusion.sample(oracle, generator=torch.Generator().manual_seed(1), **kwargs)
    plain, plain_stats = diffusion.sample(oracle, generator=torch.Generator().manual_seed(1),
                                          cache=False, **kwargs)
    assert torch.equal(cached, plain)
    assert plain_stats.network_calls == 200 and plain_stats.rows_evaluated == 200 * 64
    assert cached_stats.network_calls < plain_stats.network_calls
    # Each sequence changes at most L times, so it is evaluated at most L times.
    assert cached_stats.rows_evaluated <= 64 * 4


def test_many_steps_cost_about_seq_len_calls():
    net = Transformer(TransformerConfig(vocab_size=7, n_layers=1, d_model=16, n_heads=2, max_seq_len=12)).eval()
    diffusion = MaskedDiffusion(make_schedule("linear"), 7)
    with torch.no_grad():
        out, stats = diffusion.sample(net, 1, 12, steps=5000, generator=torch.Generator().manual_seed(0),
                                      return_stats=True)
    assert bool((out < 7).all())
    assert stats.steps == 5000 and stats.network_calls <= 12


def test_time_conditioned_denoiser_sees_the_current_time():
    diffusion = MaskedDiffusion(make_schedule("linear"), 4)
    denoiser = ConstantDenoiser(torch.full((4,), 0.25))
    diffusion.sample(denoiser, 3, 6, steps=50, generator=torch.Generator().manual_seed(0))
    grid = time_grid(50, "uniform")
    times = [float(t[0]) for t in denoiser.calls]
    assert times == sorted(times, reverse=True)
    assert all(any(abs(t - float(g)) < 1e-12 for g in grid[:-1]) for t in times)


def test_top_p_filter_keeps_the_nucleus():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([[0, 0.625, 0, 0.375]], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([[0, 1.0, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 1.0), probs)


def test_sampling_with_top_p_draws_only_from_the_nucleus():
    diffusion = MaskedDiffusion(make_schedule("linear"), 4)
    denoiser = ConstantDenoiser(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    out = diffusion.sample(denoiser, 400, 16, steps=16, top_p=0.7, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(out.flatten(), minlength=4).double()
    assert counts[0] == 0 and counts[2] == 0
    assert abs(float(counts[1] / counts.sum()) - 0.625) < 0.02
    full = diffusion.sample(denoiser, 400, 16, steps=16, generator=torch.Generator().manual_seed(0))
    assert abs(float((full == 0).double().mean()) - 0.15) < 0.02


def testinverse_cdf_resolves_probabilities_float32_cannot():
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

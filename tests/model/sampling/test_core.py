"""What every sampler shares (``model.sampling.core``): the token distribution of a plan
(temperature, nucleus), float64 inverse-CDF draws, and the time grids."""

from dataclasses import replace

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan, inverse_cdf, time_grid, top_p_filter
from model.schedules import make_schedule
from tests.support.denoisers import ConstantDenoiser


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

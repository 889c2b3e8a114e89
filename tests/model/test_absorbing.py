"""AbsorbingDiffusion: forward process, SUBS invariants, time sampling and input validation."""

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.process import low_discrepancy_times
from model.sampling import SamplingPlan
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig

VOCAB = 11


@pytest.fixture
def diffusion():
    return AbsorbingDiffusion(make_schedule("linear"), VOCAB)


def _tokens(batch=4, length=16, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_corrupt_masks_at_the_scheduled_rate_and_keeps_the_rest(diffusion):
    x0 = _tokens(batch=3, length=20_000)
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    z = diffusion.corrupt(x0, t, torch.Generator().manual_seed(1))
    masked = z == diffusion.mask_id
    assert bool((z[~masked] == x0[~masked]).all())
    rate = diffusion.schedule.masking_rate(t)
    standard_error = (rate * (1 - rate) / x0.shape[1]).sqrt()
    assert bool(((masked.double().mean(1) - rate).abs() < 4 * standard_error).all())


def test_low_discrepancy_times_cover_the_interval_and_split_over_ranks():
    generator = lambda: torch.Generator().manual_seed(7)  # same seed on every "rank"
    full = low_discrepancy_times(8, generator())
    assert bool(((full >= 0) & (full < 1)).all())
    torch.testing.assert_close(full.sort().values.diff(), torch.full((7,), 1 / 8, dtype=torch.float64))
    # Two ranks x two micro-batches of 2 reproduce the global batch of 8.
    slices = [low_discrepancy_times(2, generator(), offset=offset, global_batch_size=8)
              for offset in (0, 2, 4, 6)]
    torch.testing.assert_close(torch.cat(slices), full)
    # Marginally uniform: the shared offset u is.
    draws = torch.stack([low_discrepancy_times(1, torch.Generator().manual_seed(s)) for s in range(2000)])
    assert abs(float(draws.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / 2000)


def test_low_discrepancy_times_refuse_a_slice_outside_the_batch():
    with pytest.raises(ValueError, match="offset"):
        low_discrepancy_times(4, offset=6, global_batch_size=8)


def test_nelbo_terms_use_the_given_times_and_add_up(diffusion):
    x0 = _tokens()
    denoiser = lambda z, t: torch.zeros(*z.shape, VOCAB)  # uniform prediction
    t = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    terms = diffusion.nelbo_terms(denoiser, x0, t, torch.Generator().manual_seed(0))
    assert terms.t is t
    torch.testing.assert_close(terms.total, terms.diffusion + terms.reconstruction + terms.prior)
    # Uniform prediction: every masked token costs log V, weighted by w(t).
    torch.testing.assert_close(terms.diffusion, diffusion.schedule.weight(t) * terms.num_masked * math.log(VOCAB))
    alpha_one = float(diffusion.schedule.alpha(torch.ones(1, dtype=torch.float64)))
    torch.testing.assert_close(terms.prior, torch.full((4,), 16 * alpha_one * math.log(VOCAB), dtype=torch.float64))


def test_uniform_reconstruction_is_the_exact_expectation(diffusion):
    x0 = _tokens(batch=20_000, length=8)
    uniform = lambda z, t: torch.zeros(*z.shape, VOCAB)
    generator = torch.Generator().manual_seed(3)
    model_terms = diffusion.nelbo_terms(uniform, x0, generator=generator, reconstruction="model")
    uniform_terms = diffusion.nelbo_terms(uniform, x0, generator=generator, reconstruction="uniform")
    expected = 8 * diffusion.schedule.endpoint_eps * math.log(VOCAB)
    torch.testing.assert_close(uniform_terms.reconstruction, torch.full((20_000,), expected, dtype=torch.float64))
    standard_error = model_terms.reconstruction.std() / math.sqrt(20_000)
    assert abs(float(model_terms.reconstruction.mean()) - expected) < 4 * standard_error


def test_subs_unmasked_predictions_do_not_matter(diffusion):
    """Carry-over: only masked positions are scored, whatever the network says elsewhere."""
    x0 = _tokens()
    base = torch.randn(4, 16, VOCAB, generator=torch.Generator().manual_seed(5))

    def sane(z, t):
        return base.clone()

    def garbage_at_unmasked(z, t):
        out = base.clone()
        out[z != VOCAB] = torch.randn(int((z != VOCAB).sum()), VOCAB) * 100
        return out

    a = diffusion.nelbo(sane, x0, generator=torch.Generator().manual_seed(9))
    b = diffusion.nelbo(garbage_at_unmasked, x0, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_subs_denoiser_with_a_mask_logit_is_refused(diffusion):
    with pytest.raises(ValueError, match="no mask logit"):
        diffusion.nelbo(lambda z, t: torch.zeros(*z.shape, VOCAB + 1), _tokens())


def test_log_softmax_runs_in_float32_under_bf16(diffusion):
    x0 = _tokens()
    logits = (torch.randn(4, 16, VOCAB, generator=torch.Generator().manual_seed(2)) * 8).bfloat16()
    bf16 = diffusion.nelbo(lambda z, t: logits, x0, generator=torch.Generator().manual_seed(4))
    upcast = diffusion.nelbo(lambda z, t: logits.float(), x0, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(bf16, upcast, rtol=0, atol=0)


def test_masked_only_logits_give_the_same_bound():
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=2, max_seq_len=16,
                               time_conditioning=True)
    net = Transformer(config).eval()
    for p in net.parameters():  # leave adaLN-zero's identity start so t matters
        torch.nn.init.normal_(p, std=0.05)
    diffusion = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    x0 = _tokens()
    full = diffusion.nelbo(lambda z, t: net(z, t), x0, generator=torch.Generator().manual_seed(1))
    masked_only = diffusion.nelbo(net, x0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full, masked_only, rtol=1e-5, atol=1e-5)


def test_nelbo_is_differentiable():
    net = Transformer(TransformerConfig(vocab_size=VOCAB, n_layers=1, d_model=16, n_heads=2, max_seq_len=16))
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    diffusion.nelbo(net, _tokens(), reconstruction="uniform").mean().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in net.parameters())


@pytest.mark.parametrize("make_call,match", [
    (lambda d, x: d.nelbo(None, x.float()), "x0 must be a LongTensor"),
    (lambda d, x: d.nelbo(None, x[0]), r"x0 must have shape \[batch, length\]"),
    (lambda d, x: d.nelbo(None, x + VOCAB), r"x0 holds token ids in .* outside \[0, 10\]"),
    (lambda d, x: d.nelbo(None, x - VOCAB), "x0 holds token ids"),
    (lambda d, x: d.corrupt(x, torch.tensor([0.5, 1.5, 0.1, 0.2])), r"t must lie in \[0, 1\]"),
    (lambda d, x: d.corrupt(x, torch.tensor([-0.1, 0.5, 0.1, 0.2])), r"t must lie in \[0, 1\]"),
    (lambda d, x: d.corrupt(x, torch.tensor([0.5, 0.5])), r"t must have shape \[4\]"),
    (lambda d, x: d.corrupt(x, torch.tensor([0, 1, 0, 1])), "t must be a floating-point tensor"),
    (lambda d, x: d.nelbo_discrete(None, x, 0), "steps must be an int >= 1"),
    (lambda d, x: d.nelbo_discrete(None, x, 2.5), "steps must be an int >= 1"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=0, seq_len=16), "num_samples must be an int >= 1"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=2, seq_len=0), "seq_len must be an int >= 1"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=4, seq_len=16, prompt=x + 2),
     r"prompt holds token ids .* outside \[0, 11\]"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=4, seq_len=8, prompt=x),
     r"prompt must have shape \[8\]"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4, block_len=9), num_samples=4, seq_len=16, window=8),
     "block_len 9 exceeds the network's window of 8"),
])
def test_bad_input_raises_value_error_naming_the_argument(diffusion, make_call, match):
    with pytest.raises(ValueError, match=match):
        make_call(diffusion, _tokens())


def test_constructor_validates(diffusion):
    with pytest.raises(ValueError, match="vocab_size"):
        AbsorbingDiffusion(make_schedule("linear"), 1)
    with pytest.raises(ValueError, match="schedule"):
        AbsorbingDiffusion("linear", VOCAB)
    assert diffusion.mask_id == VOCAB

"""AbsorbingDiffusion (``model.absorbing``): the forward process, SUBS's invariants, scoring only
some positions (padding), input validation; and the exact-conditionals identity
(docs/math.md#the-exact-conditionals-identity) checked with the oracle's exact conditionals:
with the optimal denoiser the continuous NELBO is -log p(x) (up to the endpoint terms,
O(L * eps * log V)) and the Monte Carlo estimator agrees within its standard error; the
discrete-time bound is looser and tightens as T grows; ancestral sampling reproduces p."""

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import SamplingPlan
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.support.oracle import EnumerableDistribution, conditional_nll
from tests.support.stats import z_scores

VOCAB = 11  # the mechanics' vocabulary; the oracle's is ORACLE_VOCAB
ORACLE_VOCAB, ORACLE_LENGTH = 3, 4
ORACLE_SIZE = (ORACLE_VOCAB, ORACLE_LENGTH)  # the conftest's `oracle` fixture
SCHEDULES = [("linear", {}), ("cosine", {}), ("polynomial", {"power": 2.0}), ("loglinear", {})]
Z_LIMIT = 4.0  # |estimate - truth| / standard error; deterministic seeds, so no flakes


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


# ---------------------------------------------------------------- scoring only some positions
def _linear() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), ORACLE_VOCAB)


def _fixed_logits_denoiser(batch: int, length: int, vocab: int):
    base = torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(11))
    calls = []

    def denoiser(z, t):
        calls.append(z.clone())
        return base[:z.shape[0]].clone()

    return denoiser, calls


def test_all_true_positions_match_none_bit_for_bit():
    vocab, batch, length = 11, 6, 16
    # A large endpoint eps so the model-scored reconstruction term is exercised too.
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.05), vocab)
    x0 = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    everywhere = torch.ones_like(x0, dtype=torch.bool)
    denoiser, _ = _fixed_logits_denoiser(batch, length, vocab)
    calls = {
        "model": lambda g, p: diffusion.nelbo_terms(denoiser, x0, generator=g, positions=p),
        "uniform": lambda g, p: diffusion.nelbo_terms(denoiser, x0, generator=g, positions=p,
                                                      reconstruction="uniform"),
        "discrete": lambda g, p: diffusion.nelbo_discrete(denoiser, x0, 4, g, positions=p),
    }
    for name, call in calls.items():
        g_none, g_all = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        a, b = call(g_none, None), call(g_all, everywhere)
        for field in ("t", "diffusion", "reconstruction", "prior", "num_masked", "total"):
            if name != "discrete":
                torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=0, atol=0)
        if name == "discrete":
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # The same random numbers were consumed: the streams continue identically.
        assert torch.equal(g_none.get_state(), g_all.get_state()), name
    assert bool((calls["model"](torch.Generator().manual_seed(3), None).reconstruction > 0).any())


def test_padding_is_never_masked_and_is_seen_as_given():
    vocab = 11
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=1e-9), vocab)
    x0 = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(32)[None, :] < torch.tensor([32, 20, 5, 1])[:, None]
    near_one = torch.full((4,), 1.0, dtype=torch.float64)  # masks every real token (but 1e-9)
    for seed in range(20):
        z = diffusion.corrupt(x0, near_one, torch.Generator().manual_seed(seed), positions=positions)
        assert torch.equal(z[~positions], x0[~positions])
        assert bool((z[positions] == diffusion.mask_id).all())
    denoiser, calls = _fixed_logits_denoiser(4, 32, vocab)
    terms = diffusion.nelbo_terms(denoiser, x0, near_one, torch.Generator().manual_seed(0),
                                  positions=positions, reconstruction="uniform")
    assert all(torch.equal(z[~positions], x0[~positions]) for z in calls)
    assert torch.equal(terms.num_masked, positions.sum(-1))  # t = 1: all real tokens, no padding
    # The endpoint terms count the real tokens only (a visible eps to see them).
    guarded = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.05), vocab)
    terms = guarded.nelbo_terms(denoiser, x0, near_one, torch.Generator().manual_seed(0),
                                positions=positions, reconstruction="uniform")
    real = positions.sum(-1).double()
    expected = real * 0.05 * math.log(vocab)  # alpha(1) = 1 - alpha(0) = eps
    torch.testing.assert_close(terms.prior, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.reconstruction, expected, rtol=1e-12, atol=0)


def test_a_sequence_without_real_positions_has_bound_zero():
    vocab = 11
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.2), vocab)
    x0 = torch.randint(0, vocab, (3, 8), generator=torch.Generator().manual_seed(4))
    nothing = torch.zeros_like(x0, dtype=torch.bool)
    denoiser, _ = _fixed_logits_denoiser(3, 8, vocab)
    zeros = torch.zeros(3, dtype=torch.float64)
    for reconstruction in ("model", "uniform"):
        bound = diffusion.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(5),
                                positions=nothing, reconstruction=reconstruction)
        torch.testing.assert_close(bound, zeros, rtol=0, atol=0)
    discrete = diffusion.nelbo_discrete(denoiser, x0, 3, torch.Generator().manual_seed(5), positions=nothing)
    torch.testing.assert_close(discrete, zeros, rtol=0, atol=0)


def test_padded_bound_is_minus_log_likelihood_given_the_visible_padding(oracle):
    """With exact conditionals, E[NELBO] = -log p(x_0, x_1 | x_2, x_3) when x_2, x_3 are padding."""
    diffusion = _linear()
    order = oracle.probs.argsort(descending=True)
    sequences = oracle.sequences[order[[0, 3, 20, 60]]]
    positions = torch.tensor([True, True, False, False]).expand_as(sequences)
    repeats = 10_000
    estimates = diffusion.nelbo(oracle, sequences.repeat(repeats, 1), positions=positions.repeat(repeats, 1),
                                generator=torch.Generator().manual_seed(6)).view(repeats, -1)
    truth = torch.tensor([conditional_nll(oracle, x, p) for x, p in zip(sequences, positions)],
                         dtype=torch.float64)
    standard_error = estimates.std(0) / math.sqrt(repeats)
    assert ((estimates.mean(0) - truth).abs() / standard_error).max() < Z_LIMIT
    # The test can tell: scoring the padding too would give -log p(x), far away.
    assert ((-oracle.log_prob(sequences) - truth) / standard_error).min() > 5 * Z_LIMIT


def test_one_generator_per_row_makes_a_row_independent_of_its_batch():
    vocab = 11
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=0.05), vocab)
    x0 = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(7))
    t = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    denoiser = lambda z, t: torch.zeros(*z.shape, vocab) + z[..., None].float()  # depends on z only
    rows = lambda *seeds: [torch.Generator().manual_seed(s) for s in seeds]
    batch = diffusion.nelbo_terms(denoiser, x0, t, rows(1, 2, 3))
    alone = diffusion.nelbo_terms(denoiser, x0[1:2], t[1:2], rows(2))
    torch.testing.assert_close(batch.total[1:2], alone.total, rtol=0, atol=0)
    torch.testing.assert_close(batch.num_masked[1:2], alone.num_masked, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass t"):
        diffusion.nelbo(denoiser, x0, None, rows(1, 2, 3))
    with pytest.raises(ValueError, match="pass u"):
        diffusion.nelbo_discrete(denoiser, x0, 4, rows(1, 2, 3))
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        diffusion.nelbo(denoiser, x0, t, rows(1, 2))


@pytest.mark.parametrize("positions,match", [
    (torch.ones(3, 16, dtype=torch.long), "positions must be a BoolTensor"),
    (torch.ones(3, 15, dtype=torch.bool), "positions must have the shape of x0"),
])
def test_bad_positions_are_refused(positions, match):
    diffusion = _linear()
    with pytest.raises(ValueError, match=match):
        diffusion.nelbo(lambda z, t: torch.zeros(*z.shape, ORACLE_VOCAB), torch.zeros(3, 16, dtype=torch.long),
                        positions=positions)


# ---------------------------------------------------------------- the exact-conditionals identity
@pytest.fixture(scope="module")
def sequences(oracle):
    """Five distinct sequences: likely and unlikely ones."""
    order = oracle.probs.argsort(descending=True)
    return oracle.sequences[order[[0, 1, 10, 40, 80]]]


def test_oracle_is_exact(oracle, sequences):
    """The denoiser is the true conditional: check one case by hand."""
    z = sequences.clone()
    z[:, 1] = ORACLE_VOCAB  # mask position 1
    logits = oracle.conditional_logits(z)
    for row, x in enumerate(sequences):
        match = (oracle.sequences[:, [0, 2, 3]] == x[[0, 2, 3]]).all(-1)
        joint = torch.zeros(ORACLE_VOCAB, dtype=torch.float64).index_add_(
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
    diffusion = AbsorbingDiffusion(schedule, ORACLE_VOCAB)
    repeats = 20_000
    batch = sequences.repeat(repeats, 1)  # tiled: every x sees the whole time interval
    estimates = diffusion.nelbo(oracle, batch, generator=torch.Generator().manual_seed(1))
    estimates = estimates.view(repeats, len(sequences))
    exact = oracle.exact_nelbo(sequences, schedule)
    minus_log_p = -oracle.log_prob(sequences)
    # The endpoint terms keep the exact guarded bound within L * eps * log V of -log p(x).
    alpha = schedule.alpha(torch.tensor([0.0, 1.0], dtype=torch.float64))
    endpoint_scale = ORACLE_LENGTH * float(1 - alpha[0] + alpha[1]) * math.log(ORACLE_VOCAB)
    assert (exact - minus_log_p).abs().max() < endpoint_scale
    assert z_scores(estimates, exact).max() < Z_LIMIT
    assert z_scores(estimates, minus_log_p).max() < Z_LIMIT


def test_low_discrepancy_times_lower_the_variance(oracle, sequences):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), ORACLE_VOCAB)
    batch = sequences[:1].repeat(4096, 1)
    generator = torch.Generator().manual_seed(2)
    stratified = [diffusion.nelbo(oracle, batch, generator=generator).mean() for _ in range(40)]
    iid = [diffusion.nelbo(oracle, batch, t=torch.rand(4096, generator=generator, dtype=torch.float64),
                           generator=generator).mean() for _ in range(40)]
    assert torch.stack(stratified).var() < 0.5 * torch.stack(iid).var()


@pytest.mark.parametrize("name,kwargs", SCHEDULES[:3])
def test_discrete_bound_is_looser_and_tightens_with_steps(oracle, sequences, name, kwargs):
    schedule = make_schedule(name, **kwargs)
    diffusion = AbsorbingDiffusion(schedule, ORACLE_VOCAB)
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
        assert z_scores(estimates.view(repeats, -1), exact).max() < Z_LIMIT


def _total_variation(samples: torch.Tensor, oracle: EnumerableDistribution) -> float:
    counts = torch.bincount(oracle.index_of(samples), minlength=len(oracle.probs))
    return 0.5 * float((counts / counts.sum() - oracle.probs).abs().sum())


@pytest.mark.parametrize("name,grid", [("linear", "uniform"), ("cosine", "cosine"), ("polynomial", "uniform")])
def test_ancestral_sampling_reproduces_the_distribution(oracle, name, grid):
    kwargs = {"power": 2.0} if name == "polynomial" else {}
    diffusion = AbsorbingDiffusion(make_schedule(name, **kwargs), ORACLE_VOCAB)
    num = 20_000
    generator = torch.Generator().manual_seed(3)
    samples, _ = diffusion.sample(oracle, SamplingPlan(steps=100, grid=grid), num_samples=num, seq_len=ORACLE_LENGTH,
                                  generator=generator)
    reference = _total_variation(oracle.sample(num, generator), oracle)  # pure sampling noise
    assert _total_variation(samples, oracle) < 1.5 * reference + 0.01
    # The test can tell a wrong sampler: one step unmasks all at once from the marginals.
    one_step, _ = diffusion.sample(oracle, SamplingPlan(steps=1), num_samples=num, seq_len=ORACLE_LENGTH, generator=generator)
    assert _total_variation(one_step, oracle) > 3 * reference

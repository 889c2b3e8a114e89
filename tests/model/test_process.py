"""The diffusion process interface (``model.process``): the same user code trains, scores and
samples with AbsorbingDiffusion, LearnedDiffusion (GenMD4) and UniformDiffusion (D3PM); and the
low-discrepancy times every process draws (docs/math.md#low-discrepancy-times)."""

import math

import pytest
import torch

from model import AbsorbingDiffusion, LearnedDiffusion, LearnedSchedule, UniformDiffusion, make_schedule
from model.process import low_discrepancy_times
from model.sampling import SamplingPlan
from model.transformer import Transformer, TransformerConfig
from tests.support.denoisers import ConstantDenoiser

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH, BATCH = 7, 12, 6
PROCESSES = {
    "absorbing": lambda: AbsorbingDiffusion(make_schedule("cosine"), VOCAB),
    "learned": lambda: LearnedDiffusion(LearnedSchedule(VOCAB, initial_exponent=1.5), VOCAB),
    "uniform": lambda: UniformDiffusion(make_schedule("cosine"), VOCAB),
}


@pytest.fixture(params=list(PROCESSES))
def process(request):
    return PROCESSES[request.param]()


def _network(time_conditioning: bool = True) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, n_layers=1, d_model=16, n_heads=2, max_seq_len=LENGTH,
                               time_conditioning=time_conditioning)
    net = Transformer(config)
    for p in net.parameters():  # leave adaLN-zero's identity start so that t matters
        torch.nn.init.normal_(p, std=0.1)
    return net


def _tokens(seed: int = 0, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


def test_the_same_user_code_trains_scores_and_samples(process):
    net = _network()
    schedule_parameters = list(process.schedule.parameters()) if isinstance(process.schedule, torch.nn.Module) else []
    optimizer = torch.optim.AdamW([*net.parameters(), *schedule_parameters], lr=1e-3)
    x0, g = _tokens(), torch.Generator().manual_seed(1)

    loss = process.nelbo(net, x0, generator=g, reconstruction="uniform").mean() / LENGTH
    loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in net.parameters())
    assert all(bool((p.grad != 0).all()) for p in schedule_parameters)  # GenMD4's theta learns too
    optimizer.step()

    with torch.no_grad():
        terms = process.nelbo_terms(net, x0, generator=g)
        torch.testing.assert_close(terms.total, terms.diffusion + terms.reconstruction + terms.prior)
        assert terms.t.shape == (BATCH,) and bool((terms.total > 0).all())
        assert bool(torch.isfinite(process.nelbo_discrete(net, x0, 16, generator=g)).all())

        positions = torch.ones_like(x0, dtype=torch.bool)
        positions[:, -3:] = False  # padding: never corrupted, never scored
        z = process.corrupt(x0, torch.full((BATCH,), 0.9, dtype=torch.float64), g, positions=positions)
        assert torch.equal(z[:, -3:], x0[:, -3:]) and int(z.max()) <= process.generate_id
        assert bool(torch.isfinite(process.nelbo(net, x0, generator=g, positions=positions)).all())

        prompt = torch.full((LENGTH,), process.generate_id)  # generate where it holds V
        prompt[:2], prompt[-1] = x0[0, :2], x0[0, -1]
        tokens, stats = process.sample(net.eval(), SamplingPlan(steps=20, grid="cosine", top_p=0.9),
                                       num_samples=4, seq_len=LENGTH, prompt=prompt, generator=g)
    assert tokens.shape == (4, LENGTH) and bool((tokens < VOCAB).all()) and bool((tokens >= 0).all())
    assert bool((tokens[:, :2] == x0[0, :2]).all()) and bool((tokens[:, -1] == x0[0, -1]).all())
    # At most one call a step, each on 1 to 4 rows (caching skips rows and steps with nothing to reveal).
    assert stats.steps == 20 and 1 <= stats.network_calls <= stats.steps
    assert stats.network_calls <= stats.rows_evaluated <= 4 * stats.network_calls


def test_a_rows_estimate_does_not_depend_on_its_batch(process):
    """Per-row generators (as the evaluator uses them): row i's draws come from generator i."""
    net, x0 = _network(), _tokens(batch=3)
    t = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    generators = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    with torch.no_grad():
        together = process.nelbo(net, x0, t, generators())
        alone = torch.cat([process.nelbo(net, x0[i:i + 1], t[i:i + 1], generators()[i:i + 1]) for i in range(3)])
        discrete_together = process.nelbo_discrete(net, x0, 8, generators(), u=t)
        discrete_alone = torch.cat([process.nelbo_discrete(net, x0[i:i + 1], 8, generators()[i:i + 1], u=t[i:i + 1])
                                    for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(discrete_together, discrete_alone, rtol=1e-5, atol=1e-5)


def test_scoring_every_position_is_the_default_and_masked_only_logits_agree(process):
    net, x0 = _network(), _tokens()
    everywhere = torch.ones_like(x0, dtype=torch.bool)
    with torch.no_grad():
        default = process.nelbo(net, x0, generator=torch.Generator().manual_seed(2))
        explicit = process.nelbo(net, x0, generator=torch.Generator().manual_seed(2), positions=everywhere)
        full_logits = process.nelbo(lambda z, t: net(z, t), x0, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    torch.testing.assert_close(default, full_logits, rtol=1e-5, atol=1e-5)


def test_padding_is_never_corrupted_and_never_scored(process):
    """Outside ``positions`` every z the denoiser sees holds the clean token, its predictions
    there do not count, and the endpoint terms count the real tokens only."""
    net, x0 = _network(), _tokens()
    x0[:, -3:] = 0
    positions = torch.ones_like(x0, dtype=torch.bool)
    positions[:, -3:] = False
    seen = []

    def recording(z, t, garbage_at_padding=False):
        seen.append(z)
        logits = net(z, t)
        if garbage_at_padding:
            logits[:, -3:] = torch.randn(logits[:, -3:].shape) * 100
        return logits

    garbage = lambda z, t: recording(z, t, garbage_at_padding=True)  # noqa: E731
    with torch.no_grad():
        for kind in ("model", "uniform"):
            sane = process.nelbo_terms(recording, x0, generator=torch.Generator().manual_seed(6),
                                       reconstruction=kind, positions=positions)
            scrambled = process.nelbo_terms(garbage, x0, generator=torch.Generator().manual_seed(6),
                                            reconstruction=kind, positions=positions)
            torch.testing.assert_close(sane.total, scrambled.total, rtol=0, atol=0)
        everything = process.nelbo_terms(net, x0, generator=torch.Generator().manual_seed(6), reconstruction="uniform")
        process.nelbo_discrete(recording, x0, 4, generator=torch.Generator().manual_seed(7), positions=positions)
    real = LENGTH - 3
    torch.testing.assert_close(sane.prior, everything.prior * real / LENGTH)
    torch.testing.assert_close(sane.reconstruction, everything.reconstruction * real / LENGTH)
    assert seen and all(bool((z[:, -3:] == 0).all()) for z in seen)


def test_top_p_draws_only_from_the_nucleus(process):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3, 0.0, 0.0, 0.0])  # nucleus of 0.7: tokens 1 and 3
    denoiser = ConstantDenoiser(probs + 1e-12)
    out, _ = process.sample(denoiser, SamplingPlan(steps=16, top_p=0.7), num_samples=200, seq_len=LENGTH)
    assert set(out.unique().tolist()) == {1, 3}


def test_bf16_logits_are_scored_in_float32(process):
    x0 = _tokens()
    table = (torch.randn(VOCAB + 1, VOCAB, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()  # logits by z_n
    bf16 = process.nelbo(lambda z, t: table[z], x0, generator=torch.Generator().manual_seed(4))
    upcast = process.nelbo(lambda z, t: table[z].float(), x0, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(bf16, upcast, rtol=0, atol=0)


@pytest.mark.parametrize("make_call,match", [
    (lambda d, x: d.nelbo(None, x.float()), "x0 must be a LongTensor"),
    (lambda d, x: d.nelbo(None, x[0]), r"x0 must have shape \[batch, length\]"),
    (lambda d, x: d.nelbo(None, x + VOCAB), r"x0 holds token ids in .* outside \[0, 6\]"),
    (lambda d, x: d.nelbo(None, x, reconstruction="exact"), "reconstruction must be 'model' or 'uniform'"),
    (lambda d, x: d.nelbo(None, x, positions=torch.ones(2, 2, dtype=torch.bool)), "positions must have the shape"),
    (lambda d, x: d.nelbo(lambda z, t: torch.zeros(*z.shape, VOCAB + 1), x), "no mask logit"),
    (lambda d, x: d.nelbo(None, x, generator=[torch.Generator()] * BATCH), "with one generator per row, pass t"),
    (lambda d, x: d.corrupt(x, torch.tensor([0.5, 1.5, 0.1, 0.2, 0.3, 0.4])), r"t must lie in \[0, 1\]"),
    (lambda d, x: d.corrupt(x, torch.tensor([0.5, 0.5])), r"t must have shape \[6\]"),
    (lambda d, x: d.nelbo_discrete(None, x, 0), "steps must be an int >= 1"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=0, seq_len=LENGTH), "num_samples must be an int"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=BATCH, seq_len=LENGTH, prompt=x + 2),
     r"prompt holds token ids .* outside \[0, 7\]"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=BATCH, seq_len=8, prompt=x),
     r"prompt must have shape \[8\]"),
    (lambda d, x: d.sample(None, SamplingPlan(steps=4), num_samples=2, seq_len=LENGTH, window=LENGTH - 1),
     "exceeds the network's window"),
])
def test_bad_input_raises_value_error_naming_the_argument(process, make_call, match):
    with pytest.raises(ValueError, match=match):
        make_call(process, _tokens())


# ------------------------------------------------------------------ low-discrepancy times
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

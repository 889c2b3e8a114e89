"""The conditional bound on log p(continuation | context) of ``evaluation.downstream.likelihoods`` (what
lm-eval's ``loglikelihood`` gets from a diffusion model), checked on the enumerable oracle.

With a time-independent denoiser q, the continuous bound on a continuation of n tokens is, in
expectation, the any-order autoregressive loss E_order sum_i -log q(x_order(i) | context,
x_order(<i)) (docs/math.md#the-exact-conditionals-identity: an average over orders), up to the endpoint guard;
the model's own likelihood is -log E_order prod_i q(...), the law of its sampler in continuous
time (it unmasks one position at a time, in a uniformly random order). So the bound is above
the exact value by a Jensen gap, which vanishes for one token and for exact conditionals.
A block diffusion model scores continuations by its block factorization; every kind of export
scores on a (pretend) device as on the host. Guided scores (LLaDA's un + (w + 1)(cond - un), un
with the context masked) are the estimator's on the guided logits: w = 0 is the bound exactly, at
twice the forward passes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from evaluation.bounds.estimator import estimate_bound, wrap_blocks
from evaluation.downstream.likelihoods import (
    ContextGuidance,
    ScoringModel,
    ScoringSettings,
    check_guidance,
    score_continuations,
    score_documents,
)
from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.denoiser import FunctionDenoiser
from model.schedules import make_schedule
from model.uniform import UniformDiffusion
from tests.support.export_fixtures import LINES
from tests.support.fake_device import DEVICE, on_fake_device

VOCAB, LENGTH = 3, 4
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
Z_LIMIT = 4.0           # deviations in standard errors (fixed seeds: a pass never flakes)
# The endpoint guard's share: alpha(0) = 1 - eps and alpha(1) = eps move the expectation by O(eps).
GUARD_TOLERANCE = 2e-3
NO_GUARD = 1e-12   # an endpoint eps small enough to leave the identity exact to float precision
LIGHT_TAILS = 0.05  # an endpoint eps that bounds w(t) = 1/t by 20 (the standard error test)
REPETITIONS = 48

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def diffusion() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), ORACLE_SIZE[0])


@pytest.fixture(scope="module")
def sequences(oracle) -> torch.Tensor:
    """Six distinct sequences (requests with one context share their draws: the checks below
    average over independent ones)."""
    return torch.unique(oracle.sample(32, torch.Generator().manual_seed(1)), dim=0)[:6]


def _pairs(x: torch.Tensor, context: int) -> list[tuple[list[int], list[int]]]:
    return [(row[:context].tolist(), row[context:].tolist()) for row in x]


def _exact_conditional_nll(oracle, x: torch.Tensor, context: int) -> torch.Tensor:
    """-log p(x[context:] | x[:context]) under the oracle's table."""
    same_prefix = (oracle.sequences[None, :, :context] == x[:, None, :context]).all(-1)
    prefix = (same_prefix.to(torch.float64) * oracle.probs[None]).sum(-1)
    return -(oracle.log_prob(x) - prefix.log())


def _inconsistent(oracle) -> FunctionDenoiser:
    """A model whose conditionals disagree with each other: with two or more masked tokens it
    predicts from another table than with one, so its orders give different likelihoods."""
    other = type(oracle).random(*ORACLE_SIZE, torch.Generator().manual_seed(5))

    def logits(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        several = (z == ORACLE_SIZE[0]).sum(-1)[:, None, None] >= 2
        return torch.where(several, other.conditional_logits(z), oracle.conditional_logits(z))

    return FunctionDenoiser(logits, time_independent=True)


def _order_terms(denoiser: FunctionDenoiser, row: torch.Tensor, context: int, mask_id: int) -> list[float]:
    """For every order of the continuation's positions: sum_i log q(x_order(i) | context, earlier)."""
    terms = []
    for order in itertools.permutations(range(context, len(row))):
        z, total = row.clone(), 0.0
        z[context:] = mask_id
        for position in order:
            logp = torch.log_softmax(denoiser.logits(z[None], torch.ones(1))[0, position].double(), -1)
            total += float(logp[row[position]])
            z[position] = row[position]
        terms.append(total)
    return terms


def _mean_and_error(scores) -> tuple[float, float]:
    """The mean over requests of minus their log-likelihoods, with its replicate standard error."""
    totals = -np.stack([score.replicates for score in scores]).mean(0)
    return float(totals.mean()), float(totals.std(ddof=1) / math.sqrt(len(totals)))


@pytest.mark.parametrize("context", [3, 2, 1])
def test_with_exact_conditionals_the_bound_is_the_exact_conditional(oracle, diffusion, sequences, context):
    exact = _exact_conditional_nll(oracle, sequences, context)
    positions = torch.arange(ORACLE_SIZE[1]) >= context
    # Without the endpoint guard the expected bound IS -log p(c | x) (eps -> 0: the identity) ...
    unguarded = oracle.exact_nelbo(sequences, make_schedule("linear", endpoint_eps=NO_GUARD), positions)
    np.testing.assert_allclose(unguarded, exact, rtol=1e-6)
    # ... and with it, the bound of a model whose prior at t = 1 differs from p by eps, O(eps) away.
    expected = oracle.exact_nelbo(sequences, diffusion.schedule, positions)
    assert float((expected - exact).abs().max()) < GUARD_TOLERANCE
    scores = score_continuations(ScoringModel(diffusion, oracle, ORACLE_SIZE[1]), _pairs(sequences, context),
                                 ScoringSettings(samples=512, seed=context))
    mean, error = _mean_and_error(scores)
    assert abs(mean - float(expected.mean())) < Z_LIMIT * error
    assert all(score.standard_error > 0 for score in scores)


def test_the_bound_is_tight_for_one_token_and_above_the_model_for_more(oracle, diffusion, sequences):
    denoiser = _inconsistent(oracle)
    model = ScoringModel(diffusion, denoiser, ORACLE_SIZE[1])
    for context, gap in ((3, False), (1, True)):
        orders = [_order_terms(denoiser, row, context, diffusion.mask_id) for row in sequences]
        bound = np.array([-np.mean(terms) for terms in orders])                      # E[bound], no guard
        likelihood = np.array([-math.log(np.mean(np.exp(terms))) for terms in orders])   # -log p_model(c | x)
        scores = score_continuations(model, _pairs(sequences, context), ScoringSettings(samples=4096, seed=7))
        mean, error = _mean_and_error(scores)
        assert abs(mean - bound.mean()) < Z_LIMIT * error + GUARD_TOLERANCE * bound.mean()
        if gap:   # Jensen: strictly above the model's likelihood, by more than the noise
            assert mean - likelihood.mean() > Z_LIMIT * error
        else:     # one token: the bound is the model's exact conditional
            np.testing.assert_allclose(bound, likelihood, rtol=1e-12)
            assert abs(mean - likelihood.mean()) < Z_LIMIT * error + GUARD_TOLERANCE * likelihood.mean()


def test_the_standard_error_shrinks_as_one_over_the_square_root_of_k(oracle, sequences):
    # An endpoint guard of 0.05 bounds w(t) by 20, so that 48 repetitions measure the spread;
    # with the default 1e-4 the terms are heavy-tailed (evaluation.downstream.likelihoods' docstring): most
    # repetitions miss the rare huge terms that carry the variance.
    diffusion = AbsorbingDiffusion(make_schedule("linear", endpoint_eps=LIGHT_TAILS), ORACLE_SIZE[0])
    model = ScoringModel(diffusion, oracle, ORACLE_SIZE[1])
    pair = _pairs(sequences[:1], 1)   # one request of three tokens, scored with 48 seeds
    errors, spreads = {}, {}
    for samples in (16, 64):
        scores = [score_continuations(model, pair, ScoringSettings(samples=samples, seed=seed))[0]
                  for seed in range(REPETITIONS)]
        errors[samples] = np.mean([score.standard_error for score in scores])
        spreads[samples] = np.std([score.log_likelihood for score in scores], ddof=1)
    assert 1.6 < errors[16] / errors[64] < 2.5                  # sqrt(64 / 16) = 2
    assert 1.5 < spreads[16] / spreads[64] < 3.0                # the estimate's spread shrinks so
    for samples in (16, 64):                                    # and the error is that spread
        assert 0.6 < spreads[samples] / errors[samples] < 1.6


def test_choices_that_share_a_context_share_their_draws(oracle, diffusion, sequences):
    """Common random numbers: the bounds of two choices after one context move together, so
    their difference (what a multiple-choice accuracy reads) is far less noisy than either."""
    model = ScoringModel(diffusion, oracle, ORACLE_SIZE[1])
    context = sequences[0, :2].tolist()
    unrelated = next(row[:2].tolist() for row in sequences if row[:2].tolist() != context)
    settings = ScoringSettings(samples=256, seed=0)
    shared = score_continuations(model, [(context, [0, 1]), (context, [1, 1])], settings)
    apart = score_continuations(model, [(context, [0, 1]), (unrelated, [1, 1])], settings)
    assert np.corrcoef(shared[0].replicates, shared[1].replicates)[0, 1] > 0.9
    assert abs(np.corrcoef(apart[0].replicates, apart[1].replicates)[0, 1]) < 0.3


def test_is_greedy_is_the_argmax_at_the_all_masked_continuation(oracle, diffusion, sequences):
    model = ScoringModel(diffusion, oracle, ORACLE_SIZE[1])
    context = sequences[:, :2]
    masked = torch.cat([context, torch.full((len(context), 2), diffusion.mask_id)], 1)
    argmax = oracle.conditional_logits(masked)[:, 2:].argmax(-1)                   # [B, 2]
    other = (argmax + 1) % ORACLE_SIZE[0]
    pairs = [(c.tolist(), a.tolist()) for c, a in zip(context, argmax)]
    pairs += [(c.tolist(), [int(a[0]), int(o[1])]) for c, a, o in zip(context, argmax, other)]
    scores = score_continuations(model, pairs, ScoringSettings(samples=2, seed=0))
    assert [score.is_greedy for score in scores] == [True] * len(context) + [False] * len(context)


def test_a_document_s_bound_is_unmask_eval_s_estimate_on_it(oracle, diffusion):
    document = oracle.sample(5, torch.Generator().manual_seed(3)).flatten().tolist()   # 20 tokens
    eos = pad = 0
    score, = score_documents(ScoringModel(diffusion, oracle, ORACLE_SIZE[1]), [document],
                             ScoringSettings(samples=8, seed=5), eos_id=eos, pad_id=pad)
    blocks = wrap_blocks([document], ORACLE_SIZE[1], eos_id=eos, pad_id=pad)
    estimate = estimate_bound(diffusion, oracle, blocks, samples_per_block=8, seed=5)
    assert -score.log_likelihood == pytest.approx(estimate.nelbo_per_token * estimate.num_tokens, rel=1e-12)
    assert score.standard_error == pytest.approx(estimate.standard_error * estimate.num_tokens, rel=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
def test_on_a_gpu_rows_fill_its_memory_and_bf16_scores_agree_with_float32():
    from model.transformer import Transformer, preset

    vocab, length = 50257, 128
    torch.manual_seed(0)
    network = Transformer(preset("small", vocab, max_seq_len=length)).eval()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), vocab, validate=False)
    rows = torch.randint(0, vocab, (24, length), generator=torch.Generator().manual_seed(1))
    pairs = [(row[:-3].tolist(), row[-3:].tolist()) for row in rows]
    settings = ScoringSettings(samples=4, seed=0)
    cpu = score_continuations(ScoringModel(diffusion, network, length), pairs, settings)
    gpu_model = ScoringModel(diffusion, network.cuda(), length, torch.device("cuda"), network.config, "absorbing")
    assert 24 < settings.rows(gpu_model, length) <= 4096     # more than a CPU batch, within the cap
    gpu = score_continuations(gpu_model, pairs, settings)
    # The same times and masks (per-row CPU generators): bf16 matmuls are the only difference.
    np.testing.assert_allclose([s.log_likelihood for s in gpu], [s.log_likelihood for s in cpu], rtol=2e-2)


# ---------------------------------------------------------------- block diffusion
@pytest.mark.parametrize("block_size", [1, 2])
def test_continuations_are_scored_by_the_block_factorization(oracle, block_size):
    """log p(c | x) of a block model: continuation blocks given the clean context blocks. With
    exact conditionals the estimate is the table's log p(c | x) within its standard error; a
    context that leaves a partial block is preceded by EOS (here token 0, scored by the table
    as the first token of the row: the truth is log p(c | 0, x))."""
    from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations

    process = BlockDiffusion(make_schedule("linear"), VOCAB, block_size)
    model = ScoringModel(process, oracle, LENGTH, pad_id=0)
    order = oracle.probs.argsort(descending=True)
    x = oracle.sequences[order[[0, 7]]]
    def log_conditional(row: torch.Tensor, given: int) -> float:
        match = (oracle.sequences[:, :given] == row[:given]).all(-1)
        return float(oracle.log_prob(row[None])[0] - oracle.probs[match].sum().log())

    pairs, truths = [(x[0, :2].tolist(), x[0, 2:].tolist())], [log_conditional(x[0], 2)]
    if block_size == 1:  # a context of one token, a continuation of three
        pairs.append((x[1, :1].tolist(), x[1, 1:].tolist()))
        truths.append(log_conditional(x[1], 1))
    else:  # a context of one token and two to continue: one EOS (0) first to fill the blocks
        pairs.append((x[1, 1:2].tolist(), x[1, 2:].tolist()))
        truths.append(log_conditional(torch.cat([torch.tensor([0]), x[1, 1:]]), 2))
    scores = score_continuations(model, pairs, ScoringSettings(samples=3000, seed=0, batch_rows=512))
    for score, truth in zip(scores, truths):
        assert abs(score.log_likelihood - truth) < Z_LIMIT * score.standard_error + 1e-3
        assert score.standard_error < 0.1 * abs(truth)


# ---------------------------------------------------------------- on a device
# float32 attention by another of SDPA's kernels, summed over a few tokens: a few float32 ulps.
SDPA_KERNEL_RTOL = 1e-6


@pytest.mark.parametrize("name", ["masked", "uniform", "learned", "block", "ar"])
def test_lm_eval_scoring_runs_on_the_device_and_gives_the_scores_of_the_host(exports_of_every_kind, name):
    exported = exports_of_every_kind[name]
    tokenizer = exported.tokenizer
    pairs = [(tokenizer.encode("the cat sat on"), tokenizer.encode(" the mat")),
             (tokenizer.encode("the dog"), tokenizer.encode(" sat on the log")),
             (tokenizer.encode("the cat sat on"), tokenizer.encode(" the hill"))]
    documents = [tokenizer.encode(line) for line in LINES[:3]]
    settings = ScoringSettings(samples=3, seed=1, batch_rows=2)

    def scores(device: torch.device) -> tuple[list, list]:
        model = ScoringModel.of(exported, device)
        return (score_continuations(model, pairs, settings),
                score_documents(model, documents, settings, eos_id=tokenizer.eos_id, pad_id=tokenizer.eos_id))

    on_host = scores(torch.device("cpu"))
    with on_fake_device():
        try:
            on_device = scores(DEVICE)
        finally:
            exported.network.to("cpu")   # the export is shared by the module's tests
    for device_scores, host_scores in zip(on_device, on_host):
        for device_score, host_score in zip(device_scores, host_scores):
            # The same draws; SDPA may pick another kernel for a tensor that is not on the CPU (float32 rounding).
            assert device_score.log_likelihood == pytest.approx(host_score.log_likelihood, rel=SDPA_KERNEL_RTOL)
            assert device_score.is_greedy == host_score.is_greedy


# ------------------------------------------------------------------------------ guidance
def _recording(oracle, inputs: list) -> FunctionDenoiser:
    """The oracle's conditionals, recording every input."""
    def logits(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        inputs.append(z.clone())
        return oracle.conditional_logits(z)

    return FunctionDenoiser(logits, time_independent=True)


def test_guidance_at_weight_zero_is_the_conditional_bound_at_twice_the_passes(oracle, diffusion, sequences):
    plain_inputs, guided_inputs = [], []
    model = ScoringModel(diffusion, _recording(oracle, plain_inputs), LENGTH)
    pairs = _pairs(sequences, 2) + _pairs(sequences, 1)
    settings = ScoringSettings(samples=4, seed=3)
    plain = score_continuations(model, pairs, settings)
    guided = score_continuations(replace(model, network=_recording(oracle, guided_inputs)), pairs, settings,
                                 guidance=0.0)
    for ours, theirs in zip(plain, guided):
        assert np.array_equal(ours.replicates, theirs.replicates) and ours.is_greedy == theirs.is_greedy
    assert sum(z.shape[0] for z in guided_inputs) == 2 * sum(z.shape[0] for z in plain_inputs)   # rows passed


def test_the_unconditional_pass_masks_the_context_and_keeps_the_continuation(oracle, diffusion, sequences):
    inputs: list[torch.Tensor] = []
    guided = ContextGuidance(_recording(oracle, inputs), 2, 1.5, diffusion.mask_id)
    z = sequences.clone()
    z[:, 3] = diffusion.mask_id
    guided.logits(z, torch.ones(len(z)))
    cond, un = inputs
    assert torch.equal(cond, z) and guided.passes == 2
    assert bool((un[:, :2] == diffusion.mask_id).all()) and torch.equal(un[:, 2:], z[:, 2:])


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_a_guided_score_is_the_estimator_on_the_guided_logits(oracle, sequences, weight):
    """LLaDA's form un + (w + 1)(cond - un), written out, scores as guidance does, and differently
    from the exact conditionals' bound on the same draws."""
    def llada(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        cond = oracle.conditional_logits(z)
        un = oracle.conditional_logits(torch.cat([torch.full_like(z[:, :3], VOCAB), z[:, 3:]], dim=1))
        return un + (weight + 1) * (cond - un)

    model = ScoringModel(AbsorbingDiffusion(make_schedule("linear", endpoint_eps=NO_GUARD), VOCAB), oracle, LENGTH)
    settings = ScoringSettings(samples=4, seed=1)
    guided = score_continuations(model, _pairs(sequences, 3), settings, guidance=weight)
    written = score_continuations(replace(model, network=FunctionDenoiser(llada, time_independent=True)),
                                  _pairs(sequences, 3), settings)
    np.testing.assert_allclose([s.log_likelihood for s in guided], [s.log_likelihood for s in written], rtol=1e-9)
    plain = score_continuations(model, _pairs(sequences, 3), settings)   # the same draws: only the logits differ
    assert not np.allclose([s.log_likelihood for s in guided], [s.log_likelihood for s in plain], rtol=1e-3)


def test_guidance_needs_a_model_with_a_mask_that_scores_a_row_at_once(oracle):
    for process in (UniformDiffusion(make_schedule("linear"), VOCAB), BlockDiffusion(make_schedule("linear"), VOCAB, 2)):
        with pytest.raises(ValueError, match="^guidance masks the context in a second pass"):
            check_guidance(ScoringModel(process, oracle, LENGTH))
        with pytest.raises(ValueError, match="^guidance masks the context"):
            score_continuations(ScoringModel(process, oracle, LENGTH), [([0], [1])], ScoringSettings(), guidance=1.0)

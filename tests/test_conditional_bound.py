"""The conditional bound on log p(continuation | context) of ``evaluation.likelihoods`` (what
lm-eval's ``loglikelihood`` gets from a diffusion model), checked on the enumerable oracle.

With a time-independent denoiser q, the continuous bound on a continuation of n tokens is, in
expectation, the any-order autoregressive loss E_order sum_i -log q(x_order(i) | context,
x_order(<i)) (MATH.md: masked diffusion = an average over orders), up to the endpoint guard;
the model's own likelihood is -log E_order prod_i q(...), the law of its sampler in continuous
time (it unmasks one position at a time, in a uniformly random order). So the bound is above
the exact value by a Jensen gap, which vanishes for one token and for exact conditionals.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from evaluation.estimator import estimate_bound, wrap_blocks
from evaluation.likelihoods import ScoringModel, ScoringSettings, score_continuations, score_documents
from model.denoiser import FunctionDenoiser
from model.diffusion import MaskedDiffusion
from model.schedules import make_schedule

ORACLE_SIZE = (3, 4)
Z_LIMIT = 4.0           # deviations in standard errors (fixed seeds: a pass never flakes)
# The endpoint guard's share: alpha(0) = 1 - eps and alpha(1) = eps move the expectation by O(eps).
GUARD_TOLERANCE = 2e-3
NO_GUARD = 1e-12   # an endpoint eps small enough to leave the identity exact to float precision

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def diffusion() -> MaskedDiffusion:
    return MaskedDiffusion(make_schedule("linear"), ORACLE_SIZE[0])


@pytest.fixture(scope="module")
def sequences(oracle) -> torch.Tensor:
    return oracle.sample(6, torch.Generator().manual_seed(1))


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


def test_the_standard_error_shrinks_as_one_over_the_square_root_of_k(oracle, diffusion, sequences):
    model = ScoringModel(diffusion, oracle, ORACLE_SIZE[1])
    pair = _pairs(sequences[:1], 1) * 48   # one request, 48 times: independent groups by seed
    errors, spreads = {}, {}
    for samples in (16, 64):
        scores = [score_continuations(model, pair[:1], ScoringSettings(samples=samples, seed=seed))[0]
                  for seed in range(len(pair))]
        errors[samples] = np.mean([score.standard_error for score in scores])
        spreads[samples] = np.std([score.log_likelihood for score in scores], ddof=1)
    assert 1.6 < errors[16] / errors[64] < 2.5                  # sqrt(64 / 16) = 2
    for samples in (16, 64):                                    # and it is the estimate's real spread
        assert 0.5 < spreads[samples] / errors[samples] < 2.0


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

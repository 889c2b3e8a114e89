"""The zero-shot bound estimator (``evaluation.bounds.estimator``): blocks, the bound of any process
with its stated error, data-parallel ranks, the discrete bound, and the autoregressive baseline.

The ground truth is an exact oracle: blocks are concatenations of independent draws of a
small enumerable distribution (V=3, L=4), whose exact conditionals, applied chunk by chunk,
are the exact conditionals of the block, so the bound must match sum -log p within its own
stated error. Blocks of 16 chunks keep the single-sample terms from being as heavy-tailed as
with L=4 (w(t) = 1/t meets a lone masked token with probability ~L*t near t=0), which is the
regime of real evaluation blocks.
"""

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from evaluation.bounds.estimator import (
    Blocks,
    BoundEstimate,
    autoregressive_nll,
    estimate_bound,
    per_time_contributions,
    replicate_terms,
    wrap_blocks,
)
from model.absorbing import AbsorbingDiffusion
from model.autoregressive import Autoregressive
from model.block_diffusion import BlockDiffusion
from model.learned import LearnedDiffusion, LearnedSchedule
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from model.uniform import UniformDiffusion
from tests.support.denoisers import TableDenoiser
from tests.support.fake_device import DEVICE, OnDevice, on_fake_device
from tests.support.oracle import EnumerableDistribution, conditional_nll

VOCAB, CHUNK = 3, 4       # the oracle: V=3, L=4 (as tests/conftest.py)
LENGTH = CHUNK            # the oracle's sequences: one block of the block diffusion checks
ORACLE_SIZE = (VOCAB, CHUNK)  # the conftest's `oracle` fixture
CHUNKS_PER_BLOCK = 16     # blocks of 64 tokens
Z_LIMIT = 4.0             # |estimate - truth| / SE for single deterministic checks
RELATIVE = 1e-12          # "identical up to float summation order"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ProductOracle:
    """Exact conditionals of blocks made of independent oracle chunks (a denoiser)."""

    def __init__(self, oracle: EnumerableDistribution) -> None:
        self.oracle = oracle

    def __call__(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch, length = z.shape
        return self.oracle.conditional_logits(z.reshape(-1, CHUNK)).reshape(batch, length, VOCAB)


def _oracle_blocks(oracle, num_blocks: int, seed: int, padding: int = 0) -> tuple[Blocks, float]:
    """Blocks of oracle draws, the last ``padding`` positions padding; and the exact bound per token."""
    tokens = oracle.sample(num_blocks * CHUNKS_PER_BLOCK, torch.Generator().manual_seed(seed))
    tokens = tokens.reshape(num_blocks, CHUNK * CHUNKS_PER_BLOCK)
    positions = torch.ones_like(tokens, dtype=torch.bool)
    if padding:
        positions[-1, -padding:] = False
    blocks = Blocks(tokens, positions)
    return blocks, conditional_nll(oracle, tokens, positions) / blocks.num_tokens


def _linear() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), VOCAB)


def _close(a: BoundEstimate, b: BoundEstimate) -> None:
    assert a.nelbo_per_token == pytest.approx(b.nelbo_per_token, rel=RELATIVE, abs=0)
    assert a.standard_error == pytest.approx(b.standard_error, rel=1e-9, abs=0)
    shape = lambda e: (e.samples_per_block, e.num_tokens, e.num_blocks, e.error_method)
    assert shape(a) == shape(b)


def _thread_all_reduce(world_size: int):
    """A summing all_reduce over threads standing in for ranks (every call is a collective)."""
    barrier = threading.Barrier(world_size, timeout=120)
    rounds: dict[int, list[list[float]]] = {}
    lock, local = threading.Lock(), threading.local()

    def all_reduce(values: list[float]) -> list[float]:
        index = local.round = getattr(local, "round", -1) + 1
        with lock:
            rounds.setdefault(index, []).append(list(values))
        barrier.wait()
        return [math.fsum(column) for column in zip(*rounds[index])]  # the same on every rank

    return all_reduce


def _on_ranks(world_size: int, run):
    """run(rank, all_reduce) on ``world_size`` threads; the per-rank results."""
    all_reduce = _thread_all_reduce(world_size)
    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(lambda rank: run(rank, all_reduce), range(world_size)))


# ---------------------------------------------------------------- wrap_blocks
def test_wrap_blocks_scores_every_token_exactly_once():
    documents = [[1, 2, 3], [4], [], [5, 6]]
    blocks = wrap_blocks(documents, 4, eos_id=9, pad_id=0)
    stream = [1, 2, 3, 9, 4, 9, 9, 5, 6, 9]  # EOS after every document, the empty one too
    assert blocks.tokens.shape == (3, 4)
    assert blocks.tokens[blocks.positions].tolist() == stream
    assert blocks.num_tokens == len(stream) and blocks.num_blocks == 3
    assert blocks.positions.tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert blocks.tokens[~blocks.positions].tolist() == [0, 0]


def test_wrap_blocks_exact_multiple_has_no_padding_and_eos_is_optional():
    blocks = wrap_blocks([[1, 2], [3]], 5, eos_id=7, pad_id=0)
    assert blocks.tokens.tolist() == [[1, 2, 7, 3, 7]] and bool(blocks.positions.all())
    plain = wrap_blocks([[1, 2], [3]], 2, eos_id=7, pad_id=8, add_eos=False)
    assert plain.tokens.tolist() == [[1, 2], [3, 8]]
    assert plain.positions.tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize("documents,kwargs,match", [
    ([], {}, "no documents"),
    ([[], []], {"add_eos": False}, "no token to score"),
    ([[1]], {"seq_len": 0}, "seq_len must be an int >= 1"),
    ([[1]], {"pad_id": -1}, "pad_id must be a non-negative int"),
])
def test_wrap_blocks_refuses_what_it_cannot_wrap(documents, kwargs, match):
    arguments = {"seq_len": 4, "eos_id": 9, "pad_id": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        wrap_blocks(documents, arguments.pop("seq_len"), **arguments)


# ---------------------------------------------------------------- estimate_bound
def test_bound_matches_the_exact_likelihood_within_its_stated_interval(oracle):
    """Over 40 seeds: the 95% interval covers the truth in >= 85% of them (expected ~94% here),
    and the stated SE matches the spread of the estimates (it is neither too small nor large)."""
    blocks, truth = _oracle_blocks(oracle, num_blocks=8, seed=1, padding=2)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    estimates = [estimate_bound(diffusion, denoiser, blocks, samples_per_block=32, seed=seed)
                 for seed in range(40)]
    values = np.array([e.nelbo_per_token for e in estimates])
    errors = np.array([e.standard_error for e in estimates])
    assert {e.error_method for e in estimates} == {"replicates"}
    covered = np.abs(values - truth) <= 1.959964 * errors
    assert covered.mean() >= 0.85
    ratio = float(np.sqrt((errors**2).mean()) / values.std(ddof=1))
    assert 0.7 < ratio < 1.4, ratio
    assert abs(values.mean() - truth) < Z_LIMIT * values.std(ddof=1) / math.sqrt(len(values))


def test_a_subset_of_blocks_per_replicate_is_unbiased_with_an_honest_interval(oracle):
    """The quick look (``blocks_per_replicate``): a quarter of the blocks per replicate, the
    same coverage of the true value as the full estimate, at a quarter of the cost."""
    blocks, truth = _oracle_blocks(oracle, num_blocks=16, seed=1)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    estimates = [estimate_bound(diffusion, denoiser, blocks, samples_per_block=32, seed=seed,
                                blocks_per_replicate=4) for seed in range(40)]
    values = np.array([e.nelbo_per_token for e in estimates])
    errors = np.array([e.standard_error for e in estimates])
    assert (np.abs(values - truth) <= 1.959964 * errors).mean() >= 0.85
    assert abs(values.mean() - truth) < Z_LIMIT * values.std(ddof=1) / math.sqrt(len(values))
    full = estimate_bound(diffusion, denoiser, blocks, samples_per_block=32, seed=0)
    assert errors.mean() > full.standard_error  # the blocks' spread widens the interval
    with pytest.raises(ValueError, match="needs samples_per_block >= 2"):
        estimate_bound(diffusion, denoiser, blocks, blocks_per_replicate=4)


class _RecordingTimes(AbsorbingDiffusion):
    """The linear absorbing process, keeping the times it is asked to score."""

    def __init__(self) -> None:
        super().__init__(make_schedule("linear"), VOCAB)
        self.times: list[float] = []

    def nelbo_terms(self, denoiser, x0, t=None, generator=None, **kwargs):
        self.times += t.tolist()
        return super().nelbo_terms(denoiser, x0, t, generator, **kwargs)


def test_a_subset_of_blocks_gets_times_stratified_over_the_subset(oracle):
    """Each replicate's n blocks take n times (u + j/n) mod 1: the subset covers [0, 1) evenly,
    as the whole set does without a subset. Independent times would leave the 1/t weight's
    small-t terms to chance (skewed totals, a too small standard error)."""
    blocks, _ = _oracle_blocks(oracle, num_blocks=16, seed=1)
    process, n, replicates = _RecordingTimes(), 4, 3
    estimate_bound(process, ProductOracle(oracle), blocks, samples_per_block=replicates, blocks_per_replicate=n,
                   batch_size=1)
    times = np.array(process.times).reshape(replicates, n)  # the work runs replicate by replicate
    for replicate in times:
        phases = np.sort(replicate) * n % 1.0
        assert np.allclose(phases, phases[0]), replicate
    assert not np.allclose(times[0], times[1])


def _learned() -> LearnedDiffusion:
    """GenMD4 with unequal exponents w = (1, 2.5, 5), so its per-value terms count;
    one draw per block, as evaluation scores it."""
    schedule = LearnedSchedule(VOCAB)
    with torch.no_grad():
        schedule.theta.copy_(torch.tensor([1.0, 2.5, 5.0]).expm1().log())  # softplus^-1(w)
    return LearnedDiffusion(schedule, VOCAB, draws=1)


@pytest.mark.parametrize("make", [lambda: UniformDiffusion(make_schedule("linear"), VOCAB), _learned],
                         ids=["uniform", "learned"])
def test_any_process_is_estimated_within_its_stated_error(oracle, make):
    """The estimator drives every process the same way: with the exact posterior of the
    process, the estimate matches the bound's exact expectation (the oracle's quadrature)."""
    process = make()
    blocks = Blocks(oracle.sample(96, torch.Generator().manual_seed(4)), torch.ones(96, CHUNK, dtype=torch.bool))
    estimate = estimate_bound(process, oracle.exact_denoiser(process), blocks, samples_per_block=32, seed=0,
                              batch_size=512)
    truth = float(oracle.exact_process_nelbo(blocks.tokens, process).sum()) / blocks.num_tokens
    assert estimate.error_method == "replicates"
    assert abs(estimate.nelbo_per_token - truth) < Z_LIMIT * estimate.standard_error


def test_interval_shrinks_with_more_samples(oracle):
    blocks, _ = _oracle_blocks(oracle, num_blocks=8, seed=2)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    mean_error = lambda k: np.mean([estimate_bound(diffusion, denoiser, blocks, samples_per_block=k,
                                                   seed=seed).standard_error for seed in range(4)])
    few, many = mean_error(4), mean_error(64)
    assert many < 0.5 * few  # 1/sqrt(16) = 0.25 expected
    low, high = estimate_bound(diffusion, denoiser, blocks, samples_per_block=64).perplexity_interval()
    assert low < high


def test_single_sample_falls_back_to_a_conservative_block_error(oracle):
    blocks, truth = _oracle_blocks(oracle, num_blocks=16, seed=3)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    estimates = [estimate_bound(diffusion, denoiser, blocks, seed=seed) for seed in range(40)]
    assert {e.error_method for e in estimates} == {"blocks"} and estimates[0].samples_per_block == 1
    values = np.array([e.nelbo_per_token for e in estimates])
    errors = np.array([e.standard_error for e in estimates])
    assert np.sqrt((errors**2).mean()) > 0.9 * values.std(ddof=1)  # not anti-conservative
    assert abs(values.mean() - truth) < Z_LIMIT * values.std(ddof=1) / math.sqrt(len(values))
    one_block = Blocks(blocks.tokens[:1], blocks.positions[:1])
    assert math.isnan(estimate_bound(diffusion, denoiser, one_block).standard_error)


def test_precision_does_not_depend_on_the_order_of_the_blocks():
    """Blocks come in document order. If a trend in difficulty met the stratified times in the
    same order, the shared uniform would move the whole total (systematic sampling of a trend):
    the random assignment of times to blocks keeps sorted blocks as precise as shuffled ones."""
    num_blocks, length = 64, 64
    real = torch.arange(length)[None] < torch.linspace(2, length, num_blocks).long()[:, None]
    ordered = Blocks(torch.zeros(num_blocks, length, dtype=torch.long), real)  # harder later
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    shuffled = Blocks(ordered.tokens[order], ordered.positions[order])

    def denoiser(z, t):  # the clean token 0 is harder to predict at larger t
        p_zero = (0.95 - 0.9 * t.float())[:, None, None]
        logits = torch.cat([p_zero.log(), ((1 - p_zero) / 2).log().expand(-1, -1, 2)], -1)
        return logits.expand(z.shape[0], z.shape[1], VOCAB)

    run = lambda blocks: estimate_bound(_linear(), denoiser, blocks, samples_per_block=64, seed=2,
                                        batch_size=64).standard_error
    assert run(ordered) < 1.6 * run(shuffled)  # in index order: about 3x


def test_discrete_bound_is_unbiased_for_its_exact_value_and_looser(oracle):
    blocks, _ = _oracle_blocks(oracle, num_blocks=8, seed=4)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    chunks = blocks.tokens.reshape(-1, CHUNK)  # independent chunks: the exact bounds add up
    steps = 2
    per_token = lambda bounds: float(bounds.sum()) / blocks.num_tokens
    exact_discrete = per_token(oracle.exact_nelbo_discrete(chunks, diffusion.schedule, steps))
    exact_continuous = per_token(oracle.exact_nelbo(chunks, diffusion.schedule))
    discrete = estimate_bound(diffusion, denoiser, blocks, samples_per_block=64, discrete_steps=steps, seed=5)
    continuous = estimate_bound(diffusion, denoiser, blocks, samples_per_block=64, seed=5)
    assert (discrete.kind, discrete.discrete_steps, continuous.kind) == ("discrete", steps, "continuous")
    assert abs(discrete.nelbo_per_token - exact_discrete) < Z_LIMIT * discrete.standard_error
    assert abs(continuous.nelbo_per_token - exact_continuous) < Z_LIMIT * continuous.standard_error
    gap_error = math.hypot(discrete.standard_error, continuous.standard_error)
    assert exact_discrete - exact_continuous > 2 * Z_LIMIT * gap_error  # the test can tell
    assert discrete.nelbo_per_token - continuous.nelbo_per_token > Z_LIMIT * gap_error


def test_target_relative_error_is_reached_deterministically(oracle):
    blocks, _ = _oracle_blocks(oracle, num_blocks=4, seed=5)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    target = 0.02
    estimate = estimate_bound(diffusion, denoiser, blocks, seed=6, target_rel_error=target)
    assert estimate.standard_error <= target * estimate.nelbo_per_token
    assert estimate.samples_per_block > 8  # more than the first round
    # Replicate k does not depend on the rounds: a fixed-K run with the final K is the same.
    fixed = estimate_bound(diffusion, denoiser, blocks, seed=6, samples_per_block=estimate.samples_per_block)
    _close(estimate, fixed)
    # And the cap is respected when the target is out of reach.
    capped = estimate_bound(diffusion, denoiser, blocks, seed=6, target_rel_error=1e-6,
                            max_samples_per_block=8)
    assert capped.samples_per_block == 8 and capped.standard_error > 1e-6 * capped.nelbo_per_token


@pytest.mark.parametrize("discrete_steps", [None, 3])
def test_result_does_not_depend_on_batch_size(oracle, discrete_steps):
    blocks, _ = _oracle_blocks(oracle, num_blocks=5, seed=6, padding=3)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    run = lambda batch: estimate_bound(diffusion, denoiser, blocks, samples_per_block=3, seed=7,
                                       batch_size=batch, discrete_steps=discrete_steps)
    reference = run(32)
    for batch in (1, 7):
        _close(run(batch), reference)


@pytest.mark.parametrize("world_size,discrete_steps", [(2, None), (3, 2)])
def test_data_parallel_ranks_reproduce_one_process(oracle, world_size, discrete_steps):
    blocks, _ = _oracle_blocks(oracle, num_blocks=7, seed=7, padding=5)  # 7 blocks: uneven shares
    denoiser, diffusion = ProductOracle(oracle), _linear()
    kwargs = dict(seed=8, batch_size=2, discrete_steps=discrete_steps, target_rel_error=0.02,
                  max_samples_per_block=16)  # several rounds, each one collective
    single = estimate_bound(diffusion, denoiser, blocks, **kwargs)
    per_rank = _on_ranks(world_size, lambda rank, reduce: estimate_bound(
        diffusion, denoiser, blocks, rank=rank, world_size=world_size, all_reduce=reduce, **kwargs))
    assert single.samples_per_block == 16  # two rounds (8, then 16), each one collective
    for estimate in per_rank:
        _close(estimate, single)


def test_per_time_contributions_explain_the_estimate(oracle):
    blocks, _ = _oracle_blocks(oracle, num_blocks=6, seed=8)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    samples = 4
    records = per_time_contributions(diffusion, denoiser, blocks, samples_per_block=samples, seed=9,
                                     batch_size=5)
    assert len(records.t) == len(records.diffusion_per_token) == samples * blocks.num_blocks
    # Each replicate's times are a stratified grid over the blocks: spacing 1/N.
    for k in range(samples):
        t = np.sort(records.t[k * blocks.num_blocks:(k + 1) * blocks.num_blocks])
        np.testing.assert_allclose(np.diff(t), 1 / blocks.num_blocks, rtol=0, atol=1e-12)
    # The same (t, z_t) as estimate_bound: its diffusion terms plus the endpoints make the bound.
    estimate = estimate_bound(diffusion, denoiser, blocks, samples_per_block=samples, seed=9)
    real = blocks.positions.sum(-1).double().numpy()[records.block]
    diffusion_per_token = (records.diffusion_per_token * real).sum() / samples / blocks.num_tokens
    prior_per_token = float(diffusion.schedule.alpha(torch.ones(1, dtype=torch.float64))) * math.log(VOCAB)
    assert diffusion_per_token + prior_per_token == pytest.approx(estimate.nelbo_per_token, abs=1e-3)
    # Rank shares partition the records.
    shares = [per_time_contributions(diffusion, denoiser, blocks, samples_per_block=samples, seed=9,
                                     rank=rank, world_size=2) for rank in (0, 1)]
    assert sorted(np.concatenate([s.t for s in shares]).tolist()) == sorted(records.t.tolist())


def test_estimate_bound_refuses_bad_arguments(oracle):
    blocks, _ = _oracle_blocks(oracle, num_blocks=2, seed=9)
    denoiser, diffusion = ProductOracle(oracle), _linear()
    cases = [({"rank": 2, "world_size": 2}, "rank must be an int in"),
             ({"samples_per_block": 0}, "samples_per_block must be an int >= 1"),
             ({"samples_per_block": 8, "max_samples_per_block": 4}, "exceeds"),
             ({"target_rel_error": 0.0}, "target_rel_error must be positive"),
             ({"discrete_steps": 0}, "discrete_steps must be an int >= 1")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            estimate_bound(diffusion, denoiser, blocks, **kwargs)
    with pytest.raises(ValueError, match="no real token"):
        estimate_bound(diffusion, denoiser, Blocks(blocks.tokens, torch.zeros_like(blocks.positions)))


# ---------------------------------------------------------------- results and the AR baseline
def test_bound_estimate_reports():
    estimate = BoundEstimate(nelbo_per_token=2.0, standard_error=0.01, num_tokens=1000, num_blocks=4,
                             samples_per_block=8, kind="continuous", discrete_steps=None, seed=0)
    assert estimate.perplexity_bound == pytest.approx(math.exp(2.0))
    low, high = estimate.perplexity_interval()
    assert (low, high) == pytest.approx((math.exp(2.0 - 1.959964 * 0.01), math.exp(2.0 + 1.959964 * 0.01)))
    assert estimate.bits_per_byte(4000) == pytest.approx(2.0 * 1000 / (math.log(2) * 4000))
    record = json.loads(json.dumps(estimate.to_dict()))
    assert record["perplexity_bound"] == pytest.approx(math.exp(2.0))
    assert record["degrees_of_freedom"] == 7 and record["kind"] == "continuous"


def test_autoregressive_nll_is_the_exact_likelihood_of_the_real_tokens():
    vocab = 7
    net = Transformer(TransformerConfig(vocab_size=vocab, n_layers=2, d_model=16, n_heads=2,
                                        max_seq_len=8, causal=True)).eval()
    torch.manual_seed(0)
    for p in net.parameters():  # away from the near-uniform start, so the test can tell
        torch.nn.init.normal_(p, std=0.3)
    generator = torch.Generator().manual_seed(10)
    documents = [torch.randint(0, vocab - 1, (int(n),), generator=generator).tolist() for n in (5, 9, 2, 1)]
    blocks = wrap_blocks(documents, 8, eos_id=vocab - 1, pad_id=0)
    assert not bool(blocks.positions.all())  # the last block is padded
    autoregressive = Autoregressive(vocab)
    # Directly: each real token scored from its prefix alone (no causal mask involved).
    total = 0.0
    with torch.no_grad():
        for tokens, real in zip(blocks.tokens, blocks.positions):
            for n in range(len(tokens)):
                if real[n]:
                    prefix = torch.cat([torch.tensor([autoregressive.start_id]), tokens[:n]])[None]
                    total -= float(torch.log_softmax(net(prefix, None)[0, -1].double(), -1)[tokens[n]])
    estimate = autoregressive_nll(autoregressive, net, blocks, batch_size=2)
    assert (estimate.kind, estimate.standard_error, estimate.error_method) == ("autoregressive", 0.0, "exact")
    assert estimate.num_tokens == blocks.num_tokens == sum(len(d) + 1 for d in documents)
    assert estimate.nelbo_per_token * estimate.num_tokens == pytest.approx(total, rel=1e-5)
    # All-real blocks agree with Autoregressive.nll; ranks reproduce one process.
    full = Blocks(blocks.tokens[:-1], blocks.positions[:-1])
    with torch.no_grad():
        reference = float(autoregressive.nll(net, full.tokens).sum()) / full.num_tokens
    assert autoregressive_nll(autoregressive, net, full).nelbo_per_token == pytest.approx(reference, rel=1e-6)
    per_rank = _on_ranks(2, lambda rank, reduce: autoregressive_nll(
        autoregressive, net, blocks, rank=rank, world_size=2, all_reduce=reduce))
    for result in per_rank:
        assert result.nelbo_per_token == pytest.approx(estimate.nelbo_per_token, rel=1e-6)


# ---------------------------------------------------------------- block diffusion
@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_the_zero_shot_estimator_reports_the_full_block_bound(oracle, block_size):
    """``estimate_bound`` with the block process and exact conditionals: the reported bound is
    -log p(x) per token within its standard error (plus the endpoint guard's few 1e-4)."""
    from evaluation.bounds.estimator import Blocks, estimate_bound

    order = oracle.probs.argsort(descending=True)
    tokens = oracle.sequences[order[[0, 3, 20, 70, 5, 1]]]
    blocks = Blocks(tokens, torch.ones_like(tokens, dtype=torch.bool))
    schedule = make_schedule("linear")
    process = BlockDiffusion(schedule, VOCAB, block_size)
    estimate = estimate_bound(process, oracle, blocks, samples_per_block=1000, batch_size=64, seed=1)
    truth = float(-oracle.log_prob(tokens).sum()) / blocks.num_tokens
    endpoint = 2 * schedule.endpoint_eps * math.log(VOCAB)
    assert abs(estimate.nelbo_per_token - truth) < Z_LIMIT * estimate.standard_error + endpoint
    assert estimate.standard_error < 0.05 * truth  # the test can tell a wrong conditioning apart


# ---------------------------------------------------------------- on a device
def _processes() -> dict:
    return {"masked": AbsorbingDiffusion(make_schedule("linear"), VOCAB),
            "uniform": UniformDiffusion(make_schedule("linear"), VOCAB),
            "learned": LearnedDiffusion(LearnedSchedule(VOCAB), VOCAB)}


# ------------------------------------------------------------------ the bound estimator
def _blocks() -> Blocks:
    tokens = torch.randint(0, VOCAB, (5, LENGTH), generator=torch.Generator().manual_seed(3))
    positions = torch.ones_like(tokens, dtype=torch.bool)
    positions[-1, 2:] = False   # a padded last block
    return Blocks(tokens, positions)


@pytest.mark.parametrize("process_name", ["masked", "uniform", "learned"])
def test_the_estimator_runs_on_the_device_and_gives_the_bound_of_the_host(process_name):
    process, blocks = _processes()[process_name], _blocks()
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=1, time_weight=0.5)
    options = dict(samples_per_block=3, seed=2, batch_size=2)
    on_host = (estimate_bound(process, denoiser, blocks, **options),
               estimate_bound(process, denoiser, blocks, discrete_steps=4, **options),
               replicate_terms(process, denoiser, blocks, **options),
               per_time_contributions(process, denoiser, blocks, **options))
    with on_fake_device():
        network = OnDevice(denoiser)
        on_device = (estimate_bound(process, network, blocks, device=DEVICE, **options),
                     estimate_bound(process, network, blocks, discrete_steps=4, device=DEVICE, **options),
                     replicate_terms(process, network, blocks, device=DEVICE, **options),
                     per_time_contributions(process, network, blocks, device=DEVICE, **options))
    assert on_device[:2] == on_host[:2]
    np.testing.assert_array_equal(on_device[2], on_host[2])
    for device_column, host_column in zip(on_device[3], on_host[3]):
        np.testing.assert_array_equal(device_column, host_column)

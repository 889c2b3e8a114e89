"""Threshold decoding: a call reveals exactly the positions above the threshold, at least
``min_tokens`` and at most ``max_tokens``; a budget caps the calls; a sample does not depend on
its batch; it runs inside semi-autoregressive blocks and block diffusion's blocks."""

import itertools

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.sampling import PlanError, SamplingPlan, ThresholdOptions, parse_sampler_options, sample_generators
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.support.denoisers import ShapeRecorder, TableDenoiser

VOCAB = 3
# The most likely token's probability at each of 8 positions: 0, 2, 4 and 7 pass 0.9.
TOP = [0.95, 0.5, 0.92, 0.4, 0.97, 0.6, 0.35, 0.91]


def _recorder() -> ShapeRecorder:
    rows = [[top, (1 - top) / 2, (1 - top) / 2] for top in TOP]
    return ShapeRecorder(torch.tensor(rows, dtype=torch.float64).log())


def _revealed_per_call(recorder: ShapeRecorder, final: torch.Tensor) -> list[list[int]]:
    states = [z[0] for z in recorder.inputs] + [final[0]]
    return [(before == VOCAB).logical_and(after != VOCAB).nonzero().flatten().tolist()
            for before, after in itertools.pairwise(states)]


def _run(options: ThresholdOptions, steps: int | None = None) -> tuple[list[list[int]], tuple[int, ...]]:
    recorder = _recorder()
    process = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    out, stats = process.sample(recorder, SamplingPlan(sampler="threshold", steps=steps, options=options),
                                num_samples=1, seq_len=len(TOP))
    assert bool((out < VOCAB).all())
    return _revealed_per_call(recorder, out), stats.row_calls


def test_a_call_reveals_exactly_the_positions_above_the_threshold_and_at_least_one():
    revealed, calls = _run(ThresholdOptions(threshold=0.9))
    # first every confident position at once, then one at a time, the most confident first
    assert revealed == [[0, 2, 4, 7], [5], [1], [3], [6]]
    assert calls == (5,)


def test_min_and_max_tokens_bound_each_call():
    revealed, _ = _run(ThresholdOptions(threshold=0.9, min_tokens=2, max_tokens=3))
    assert revealed == [[0, 2, 4], [5, 7], [1, 3], [6]]   # at most 3 (the most confident), at least 2


def test_a_budget_caps_the_calls():
    revealed, calls = _run(ThresholdOptions(threshold=0.99), steps=3)
    assert calls == (3,)
    assert [len(r) for r in revealed] == [3, 3, 2]     # ceil(8 / 3), ceil(5 / 2), the rest


def test_threshold_zero_reveals_everything_in_one_call():
    revealed, calls = _run(ThresholdOptions(threshold=0.0))
    assert calls == (1,) and revealed == [list(range(8))]


def test_a_sample_does_not_depend_on_its_batch_and_time_follows_the_masked_fraction():
    process = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    plan = SamplingPlan(sampler="threshold", seed=5, options=ThresholdOptions(threshold=0.6))
    table = TableDenoiser(VOCAB, 5, seed=1, time_weight=1.0)
    together, stats = process.sample(table, plan, num_samples=4, seq_len=5)
    for index in range(4):
        alone, _ = process.sample(table, plan, num_samples=1, seq_len=5,
                                  generator=sample_generators(plan.seed, [index]))
        assert torch.equal(alone[0], together[index])
    _first_z, first_t = table.calls[0]
    assert torch.allclose(first_t, torch.ones_like(first_t))  # all masked: t = 1
    assert max(stats.row_calls) <= 5


def test_inside_semi_autoregressive_blocks():
    recorder = _recorder()
    process = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    plan = SamplingPlan(sampler="threshold", block_len=4, options=ThresholdOptions(threshold=0.9))
    out, stats = process.sample(recorder, plan, num_samples=1, seq_len=8)
    # block 1 (top 0.95 0.5 0.92 0.4): [0, 2], [1], [3]; block 2 sees 8 positions: [4, 7], [5], [6]
    assert stats.row_calls == (6,) and bool((out < VOCAB).all())
    assert [z.shape[1] for z in recorder.inputs] == [4, 4, 4, 8, 8, 8]


def test_inside_block_diffusion_blocks_with_the_kv_cache():
    torch.manual_seed(0)
    network = Transformer(TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=32)).eval()
    process = BlockDiffusion(make_schedule("linear"), 11, 4)
    plan = SamplingPlan(sampler="threshold", options=ThresholdOptions(threshold=0.2))
    cached, stats = process.sample(network, plan, num_samples=3, seq_len=16, window=32)
    uncached, _ = process.sample(network, plan, num_samples=3, seq_len=16, window=32, kv_cache=False)
    assert torch.equal(cached, uncached) and int(cached.max()) < 11
    assert all(4 <= calls <= 16 for calls in stats.row_calls)


@pytest.mark.parametrize("pairs,field", [(["threshold=1.5"], "options.threshold"),
                                         (["min_tokens=0"], "options.min_tokens"),
                                         (["min_tokens=3", "max_tokens=2"], "options.max_tokens"),
                                         (["min_tokens=two"], "options.min_tokens")])
def test_bad_options_name_the_option(pairs, field):
    with pytest.raises(PlanError) as caught:
        parse_sampler_options("threshold", pairs)
    assert caught.value.field == field


def test_options_parse_and_the_plan_round_trips():
    options = parse_sampler_options("threshold", ["threshold=0.8", "max_tokens=4", "min_tokens=2"])
    assert options == ThresholdOptions(threshold=0.8, min_tokens=2, max_tokens=4)
    plan = SamplingPlan(sampler="threshold", options=options)
    assert plan.steps is None and SamplingPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PlanError, match="no time grid"):
        SamplingPlan(sampler="threshold", grid="cosine")

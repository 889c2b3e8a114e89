"""Whole-sequence blocks and the dual cache (``model.sampling.window``, ``model.sampling.draw``):
every call shows the network the whole sequence and reveals the current block's positions only;
with the exact conditionals and one token per call the samples follow p; a sample does not depend
on its batch; the dual cache refreshed at every call is the uncached sampler bit for bit, and
between refreshes only the block's rows run; bad options name their field."""

import itertools

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.sampling import PlanError, SamplingPlan, sample_generators
from model.sampling.window import WindowNetwork
from model.schedules import make_schedule
from model.transformer import FamilyLayers, Transformer, TransformerConfig
from model.uniform import UniformDiffusion
from tests.support.denoisers import ShapeRecorder
from tests.support.stats import chi_square_limit, chi_square_statistic

VOCAB, LENGTH, BLOCK = 11, 24, 8
PLANS = [SamplingPlan(sampler="ancestral", steps=6), SamplingPlan(sampler="first-hitting"),
         SamplingPlan(sampler="confidence", steps=4), SamplingPlan(sampler="remdm", steps=6),
         SamplingPlan(sampler="threshold")]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _network(dtype=torch.float32, time_conditioning=False, learned_positions=False) -> Transformer:
    torch.manual_seed(0)
    family = FamilyLayers(learned_positions=LENGTH) if learned_positions else None
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, max_seq_len=LENGTH,
                               time_conditioning=time_conditioning, family=family)
    return Transformer(config).to(dtype).eval()


def _prompt() -> torch.Tensor:
    """A kept start and one kept token in the last block: the suffix is not only masks."""
    prompt = torch.full((LENGTH,), VOCAB)
    prompt[:5] = torch.tensor([1, 2, 3, 4, 5])
    prompt[20] = 7
    return prompt


def _whole(plan: SamplingPlan, **fields) -> SamplingPlan:
    return SamplingPlan(**{**plan.__dict__, "block_len": BLOCK, "whole_sequence": True, **fields})


def _sample(network, plan, **kwargs):
    process = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    with torch.no_grad():
        return process.sample(network, plan, seq_len=LENGTH, prompt=_prompt(), window=LENGTH, **kwargs)


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.sampler)
def test_every_call_sees_the_whole_sequence_and_reveals_only_the_current_block(plan):
    recorder = ShapeRecorder(torch.randn(LENGTH, VOCAB, generator=torch.Generator().manual_seed(2)))
    samples, stats = _sample(recorder, _whole(plan), num_samples=2)
    assert not bool((samples == VOCAB).any()) and torch.equal(samples[:, 20], torch.full((2,), 7))
    inputs = recorder.inputs + [samples]
    assert all(z.shape[1] == LENGTH for z in recorder.inputs) and len(recorder.inputs) == stats.network_calls
    block = 0
    for before, after in itertools.pairwise(inputs):
        revealed = ((before == VOCAB) & (after != VOCAB)).any(0).nonzero().flatten()
        blocks = (revealed // BLOCK).unique()
        assert len(blocks) <= 1, f"one call revealed positions of blocks {blocks.tolist()}"
        if len(blocks):
            assert int(blocks[0]) >= block
            block = int(blocks[0])
            assert bool((before[:, (block + 1) * BLOCK:] == after[:, (block + 1) * BLOCK:]).all())
            assert bool((before[:, (block + 1) * BLOCK:] == _prompt()[(block + 1) * BLOCK:]).all())  # suffix masked
    assert block == LENGTH // BLOCK - 1


def test_with_the_exact_conditionals_and_one_token_per_call_the_samples_follow_p(oracle):
    """The table's conditionals need the whole sequence: a block alone could not be asked."""
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 3)
    plan = SamplingPlan(sampler="first-hitting", block_len=2, whole_sequence=True)
    samples, stats = diffusion.sample(oracle, plan, num_samples=6_000, seq_len=4,
                                      generator=torch.Generator().manual_seed(5))
    assert stats.row_calls == (4,) * 6_000   # one token per call
    assert chi_square_statistic(samples, oracle.probs, oracle) < chi_square_limit(len(oracle.probs) - 1)


def test_with_whole_sequence_blocks_a_sample_does_not_depend_on_its_batch():
    network = _network()
    for plan in (_whole(PLANS[0], seed=3), _whole(PLANS[4], seed=3, dual_cache=2)):
        together, _ = _sample(network, plan, num_samples=3)
        for index in range(3):
            alone, _ = _sample(network, plan, num_samples=1, generator=sample_generators(plan.seed, [index]))
            assert torch.equal(alone[0], together[index])


def test_whole_sequence_blocks_change_what_the_network_sees():
    network = _network()
    plan = SamplingPlan(sampler="confidence", steps=4, block_len=BLOCK)
    windowed, _ = _sample(network, plan, num_samples=3)
    whole, _ = _sample(network, _whole(plan), num_samples=3)
    assert not torch.equal(windowed, whole) and torch.equal(windowed[:, :5], whole[:, :5])


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.sampler)
@pytest.mark.parametrize("network", ["plain", "time-conditioned", "learned-positions"])
def test_a_dual_cache_refreshed_at_every_call_is_no_cache_bit_for_bit(plan, network):
    network = _network(time_conditioning=network == "time-conditioned",
                       learned_positions=network == "learned-positions")
    plain, plain_stats = _sample(network, _whole(plan), num_samples=3)
    for cache in ({"dual_cache": 1}, {"prefix_cache": 1}):
        cached, stats = _sample(network, _whole(plan, **cache), num_samples=3)
        assert torch.equal(plain, cached) and stats == plain_stats, cache


def test_guidance_at_weight_zero_is_the_whole_sequence_sampler_at_twice_the_calls():
    network = _network()
    plan = _whole(PLANS[0])
    plain, plain_stats = _sample(network, plan, num_samples=2)
    guided, stats = _sample(network, _whole(plan, guidance=0.0), num_samples=2)
    assert torch.equal(plain, guided) and stats.network_calls == 2 * plain_stats.network_calls
    stronger, _ = _sample(network, _whole(plan, guidance=30.0), num_samples=2)   # this network barely reads its prompt
    assert not torch.equal(plain, stronger)


@pytest.mark.parametrize("cache", [{"dual_cache": 1}, {"prefix_cache": 1}, {"prefix_cache": 1, "whole_sequence": False}])
def test_with_guidance_a_cache_refreshed_at_every_call_is_no_cache_bit_for_bit(cache):
    """The unprompted pass keeps its own keys and values: refreshed at every call, the guided samples."""
    network = _network()
    plan = _whole(PLANS[2], guidance=30.0, **{k: v for k, v in cache.items() if k == "whole_sequence"})
    plain, plain_stats = _sample(network, plan, num_samples=3)
    cached, stats = _sample(network, SamplingPlan(**{**plan.__dict__, **cache}), num_samples=3)
    assert torch.equal(plain, cached) and stats == plain_stats


def test_with_guidance_the_cached_passes_run_the_block_alone_each_on_its_own_cache():
    network = _network()
    lengths: list[int] = []
    network.embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    plan = _whole(SamplingPlan(sampler="confidence", steps=4), dual_cache=3, guidance=1.0)
    _, stats = _sample(network, plan, num_samples=1)
    assert stats.row_calls == (22,)   # two passes a call
    assert lengths == [24, 24, 8, 8, 8, 8] + [24, 24, 8, 8, 8, 8, 24, 24] * 2


def test_with_guidance_each_pass_reads_its_own_cache():
    """float64: after a refresh, an unchanged sequence gets the uncached guided logits from the cache; the
    unprompted pass would not if it read the prompted pass's keys and values."""
    network = _network(torch.float64)
    z = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    z[:, 10:] = VOCAB
    prompt = torch.zeros_like(z, dtype=torch.bool)
    prompt[:, :5] = True
    selected = z[:, :16] == VOCAB
    windows = {}
    for name, cache in (("cached", {"dual_cache": 4}), ("uncached", {})):
        windows[name] = WindowNetwork(network, _whole(SamplingPlan(), guidance=2.0, **cache), 2, VOCAB)
        windows[name].start(8, prompt, z[:, 16:])
    with torch.no_grad():
        full = windows["uncached"].logits_at(z[:, :16], None, selected)
        torch.testing.assert_close(windows["cached"].logits_at(z[:, :16], None, selected), full, rtol=0, atol=0)
        torch.testing.assert_close(windows["cached"].logits_at(z[:, :16], None, selected), full, rtol=0, atol=1e-10)


def test_a_prefix_cache_refreshed_at_every_call_keeps_learned_positions():
    """Its full forwards after the first of a block place the rows at 0, not after the cached context."""
    network = _network(learned_positions=True)
    plan = SamplingPlan(sampler="ancestral", steps=6, block_len=BLOCK)
    plain, _ = _sample(network, plan, num_samples=3)
    cached, _ = _sample(network, SamplingPlan(**{**plan.__dict__, "prefix_cache": 1}), num_samples=3)
    assert torch.equal(plain, cached)


def test_between_refreshes_only_the_block_runs():
    network = _network()
    lengths: list[int] = []
    network.embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    _, stats = _sample(network, _whole(SamplingPlan(sampler="confidence", steps=4), dual_cache=3), num_samples=1)
    # block 1 holds the prompt and 3 masks: 3 calls; blocks 2 and 3: 4 calls each (block 3 has a kept
    # token: 7 masks in 4 calls); the whole sequence at each block's first call and every 3 calls, the
    # block's 8 rows in between
    assert stats.row_calls == (11,)
    assert lengths == [24, 8, 8] + [24, 8, 8, 24] * 2


def test_the_dual_cache_holds_the_prefix_and_the_suffix_of_the_last_refresh():
    """float64: a call whose sequence did not change since the refresh gives the full forward's logits;
    a call after the suffix changed does not (the approximation)."""
    network = _network(torch.float64)
    window = WindowNetwork(network, _whole(SamplingPlan(), dual_cache=4), 2, VOCAB)
    z = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    z[:, 10:] = VOCAB
    window.start(8, torch.zeros_like(z, dtype=torch.bool), z[:, 16:])
    selected = z[:, :16] == VOCAB
    with torch.no_grad():
        full = network.logits_at(z, None, torch.cat([selected, torch.zeros_like(z[:, 16:], dtype=torch.bool)], 1))
        torch.testing.assert_close(window.logits_at(z[:, :16], None, selected), full, rtol=0, atol=0)   # refresh
        torch.testing.assert_close(window.logits_at(z[:, :16], None, selected), full, rtol=0, atol=1e-12)  # cached
        window.suffix = torch.full_like(z[:, 16:], 3)   # what the cache holds is now stale
        changed = torch.cat([z[:, :16], window.suffix], dim=1)
        fresh = network.logits_at(changed, None, torch.cat([selected, window.suffix == VOCAB], 1))
        assert not torch.allclose(window.logits_at(z[:, :16], None, selected), fresh, rtol=0, atol=1e-9)


@pytest.mark.parametrize("fields,field", [({"whole_sequence": True}, "whole_sequence"),
                                          ({"whole_sequence": 1, "block_len": 4}, "whole_sequence"),
                                          ({"dual_cache": 2, "block_len": 4}, "dual_cache"),
                                          ({"dual_cache": 0, "block_len": 4, "whole_sequence": True}, "dual_cache"),
                                          ({"dual_cache": 2, "prefix_cache": 2, "block_len": 4,
                                            "whole_sequence": True}, "dual_cache"),
                                          ({"dual_cache": 2, "static_shape": True, "block_len": 4,
                                            "whole_sequence": True}, "dual_cache")])
def test_bad_options_name_their_field(fields, field):
    with pytest.raises(PlanError) as caught:
        SamplingPlan(**fields)
    assert caught.value.field == field


def test_the_plan_records_them_only_when_set():
    assert "whole_sequence" not in SamplingPlan().to_dict() and "dual_cache" not in SamplingPlan().to_dict()
    plan = SamplingPlan(block_len=8, whole_sequence=True, dual_cache=4)
    assert SamplingPlan.from_dict(plan.to_dict()) == plan
    assert "whole sequence" in plan.describe() and "dual cache refreshed every 4 calls" in plan.describe()


def test_processes_without_a_mask_and_short_windows_refuse_whole_sequence_blocks():
    plan = SamplingPlan(block_len=4, whole_sequence=True, steps=4)
    with pytest.raises(ValueError, match="^whole_sequence: .*absorbing process"):
        UniformDiffusion(make_schedule("linear"), VOCAB).sample(_network(), plan, num_samples=1, seq_len=8)
    with pytest.raises(ValueError, match="^whole_sequence shows the network all 32 positions, more than its window"):
        AbsorbingDiffusion(make_schedule("linear"), VOCAB).sample(_network(), plan, num_samples=1, seq_len=32,
                                                                  window=LENGTH)


@pytest.mark.parametrize("fields", [{"whole_sequence": True}, {"whole_sequence": True, "dual_cache": 2}])
def test_block_diffusion_refuses_them(fields):
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 4)
    name = "dual_cache" if "dual_cache" in fields else "whole_sequence"
    with pytest.raises(ValueError, match=f"^{name}: a block diffusion model does not take it"):
        process.sample(_network(), SamplingPlan(block_len=4, **fields), num_samples=1, seq_len=8, window=LENGTH)

"""Block diffusion's sampler (``model.sampling.blocks``): block by block with a KV cache that gives
the recomputed logits bit for bit, a sample independent of its batch, generation past the
training context in a sliding window, a stop at EOS, and a call after each block (a caller's progress)."""

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.sampling import SamplingPlan, sample_generators
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig

SAMPLERS = [SamplingPlan(sampler="ancestral", steps=8), SamplingPlan(sampler="first-hitting"),
            SamplingPlan(sampler="confidence", steps=4), SamplingPlan(sampler="remdm", steps=8)]


def _sampling_network(dtype=torch.float32, shift: bool = False) -> Transformer:
    """A block diffusion network; with ``shift``, an adapted autoregressive model's (``model.shift``)."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=32, shift=shift)
    return Transformer(config).to(dtype).eval()


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
@pytest.mark.parametrize("plan", SAMPLERS, ids=lambda plan: plan.sampler)
def test_cached_samples_are_the_uncached_ones_bit_for_bit(plan, shift):
    network = _sampling_network(shift=shift)
    process = BlockDiffusion(make_schedule("linear"), 11, 4)
    prompt = torch.full((24,), 11)
    prompt[:3] = torch.tensor([1, 2, 3])  # a prefix that ends inside the first block
    kwargs = dict(num_samples=3, seq_len=24, prompt=prompt, window=32)
    cached, stats = process.sample(network, plan, **kwargs)
    uncached, _ = process.sample(network, plan, kv_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :3], prompt[:3].expand(3, -1)) and int(cached.max()) < 11
    assert stats.network_calls > 0


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
def test_the_cache_gives_the_recomputed_logits_and_a_block_sees_only_the_blocks_before_it(shift):
    """float64: the cached network outputs equal the recomputed ones to 1e-12."""
    network = _sampling_network(torch.float64, shift)
    from model.block_attention import KVCache
    from model.sampling.blocks import BlockNetwork

    x = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(0))
    block = torch.where(torch.tensor([True, False, True, False]), 11, x[:, 8:12])
    cached = BlockNetwork(network, 4)
    cached.cache, cached.prefix = KVCache(), x[:, :0]
    for start in (0, 4):
        cached.append(x[:, start:start + 4], None)
    uncached = BlockNetwork(network, 4)
    uncached.prefix = x[:, :8]
    torch.testing.assert_close(cached.logits(block, None), uncached.logits(block, None), rtol=0, atol=1e-12)
    # and it is the training forward's output at that block
    training = network(torch.cat([x[:, :8], block], 1), clean=x, block_size=4)[:, 8:]
    torch.testing.assert_close(cached.logits(block, None), training, rtol=0, atol=1e-12)


def test_samples_do_not_depend_on_the_batch():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    plan = SamplingPlan(sampler="ancestral", steps=6, seed=3)
    together, _ = process.sample(network, plan, num_samples=4, seq_len=16, window=32)
    alone, _ = process.sample(network, plan, num_samples=1, seq_len=16, window=32,
                              generator=sample_generators(3, [2]))
    assert torch.equal(together[2:3], alone)


def test_generation_runs_past_the_training_context_with_a_sliding_window():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    plan = SamplingPlan(sampler="first-hitting", seed=1)
    tokens, _ = process.sample(network, plan, num_samples=2, seq_len=80, window=32)  # 2.5 windows
    assert tokens.shape == (2, 80) and int(tokens.max()) < 11
    # while it fits in the window, it is the sample of a shorter request (blocks are left to right)
    short, _ = process.sample(network, plan, num_samples=2, seq_len=32, window=32)
    assert torch.equal(tokens[:, :32], short)


def test_generation_stops_at_eos():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    eos = 5
    plan = SamplingPlan(sampler="ancestral", steps=4, seed=0, until_eos=eos)
    tokens, _ = process.sample(network, plan, num_samples=6, seq_len=64, window=32)
    free, _ = process.sample(network, SamplingPlan(sampler="ancestral", steps=4, seed=0), num_samples=6,
                             seq_len=64, window=32)
    for row, unstopped in zip(tokens, free):
        hits = (unstopped == eos).nonzero()
        if len(hits):  # the same sample up to the block of its first EOS, then EOS only
            end = (int(hits[0]) // 4 + 1) * 4
            assert torch.equal(row[:end], unstopped[:end]) and bool((row[end:] == eos).all())
        else:
            assert torch.equal(row, unstopped)
    with pytest.raises(ValueError, match="until_eos stops a block diffusion"):
        AbsorbingDiffusion(make_schedule("linear"), 11).sample(network, plan, num_samples=1, seq_len=8)


def test_on_block_is_called_after_each_block_drawn():
    """A sample of a million tokens runs for minutes: the caller hears of every block (what
    `unmask sample` counts in its progress bar), and of no block an EOS made unnecessary."""
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    blocks = []
    process.sample(network, SamplingPlan(sampler="first-hitting", seed=1), num_samples=2, seq_len=42, window=32,
                   on_block=lambda: blocks.append(len(blocks)))
    assert len(blocks) == 11  # 10 whole blocks and the last, partial one
    stopped = []
    eos = 5
    tokens, _ = process.sample(network, SamplingPlan(sampler="ancestral", steps=4, seed=0, until_eos=eos),
                               num_samples=1, seq_len=64, window=32, on_block=lambda: stopped.append(1))
    first = int((tokens[0] == eos).nonzero()[0])
    assert len(stopped) == first // 4 + 1 < 16

"""Attention-mask annealing (``model.annealing``): the causal attention of an adapted model
opens on schedule, one draw per (seed, step), and at its start the network is the causal one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.annealing import AttentionAnnealing, annealing_at
from model.block_attention import AttentionLayout, KVCache
from model.transformer import Transformer, TransformerConfig

ROWS = 64


def test_the_schedule_ends_at_anneal_steps():
    assert annealing_at(0, 0, seed=1) is None            # 0: the target's attention from the start
    assert annealing_at(10, 10, seed=1) is None and annealing_at(11, 10, seed=1) is None
    assert [annealing_at(s, 4, seed=1).opened for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert annealing_at(3, 4, seed=1) == annealing_at(3, 4, seed=1)   # a function of (seed, step): resumable
    assert len({annealing_at(s, 100, seed=1).seed for s in range(50)} | {annealing_at(3, 100, seed=2).seed}) == 51


@pytest.mark.parametrize("opened", [0.0, 0.3, 0.8])
def test_a_step_opens_its_share_of_the_keys_ahead(opened):
    """The pairs at or behind the query always, those ahead with probability ``opened``."""
    mask = AttentionAnnealing(opened, seed=5).layout(None, ROWS, torch.device("cpu")).mask
    behind = torch.ones(ROWS, ROWS, dtype=torch.bool).tril()
    assert bool(mask[behind].all())
    ahead = mask[~behind].double()
    pairs = ahead.numel()
    standard_error = max((opened * (1 - opened) / pairs) ** 0.5, 1e-12)
    assert abs(float(ahead.mean()) - opened) < 4 * standard_error + 1e-12


def test_annealing_narrows_a_base_mask_by_position():
    """Block diffusion's mask stays the bound's: the annealing only removes pairs, by the rows' positions."""
    base = torch.rand(ROWS, ROWS, generator=torch.Generator().manual_seed(0)) < 0.5
    positions = torch.arange(ROWS) % 16
    layout = AttentionAnnealing(0.0, seed=2).layout(AttentionLayout(positions, base), ROWS, torch.device("cpu"))
    assert torch.equal(layout.mask, base & (positions[None, :] <= positions[:, None]))
    assert layout.positions is positions


def test_annealing_refuses_a_cache_or_a_flex_mask():
    cached = AttentionLayout(None, None, cache=KVCache())
    with pytest.raises(ValueError, match="not to a KV cache or a FlexAttention block mask"):
        AttentionAnnealing(0.5, seed=0).layout(cached, ROWS, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"opened must lie in \[0, 1\)"):
        AttentionAnnealing(1.0, seed=0)


def test_annealing_start_is_the_causal_network():
    """A bidirectional network at opened 0 computes what the same weights compute causally."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=16)
    network = Transformer(config).double().eval()
    causal = Transformer(dataclasses.replace(config, causal=True)).double().eval()
    causal.load_state_dict(network.state_dict())
    z = torch.randint(0, 12, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        annealed = network(z, annealing=AttentionAnnealing(0.0, seed=3))
        torch.testing.assert_close(annealed, causal(z), rtol=0, atol=1e-10)
        half = network(z, annealing=AttentionAnnealing(0.5, seed=3))
        assert not torch.allclose(half, causal(z)) and not torch.allclose(half, network(z))

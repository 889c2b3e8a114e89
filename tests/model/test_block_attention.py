"""Block attention (``model.block_attention``): the vectorized forward over [z ; x] equals a naive
loop that runs each block with its clean prefix, the dense mask is the paper's rule, and
FlexAttention's BlockMask is the dense mask entry for entry (tile size included)
(docs/math.md#block-diffusion)."""

import warnings

import pytest
import torch

from model.block_attention import (
    FLEX_TILE,
    AttentionLayout,
    block_causal_mask,
    dense_block_mask,
    flex_block_mask,
)
from model.transformer import Transformer, TransformerConfig


def _network(length: int = 16, vocab: int = 11, **overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=32, n_heads=4, max_seq_len=length, **overrides)
    return Transformer(config).double().eval()


def _naive_block_logits(network: Transformer, z: torch.Tensor, x0: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block b alone: a forward of (x0^<b, z^b), block-causal, positions 0..end-1."""
    out = []
    for start in range(0, z.shape[1], block_size):
        end = start + block_size
        sequence = torch.cat([x0[:, :start], z[:, start:end]], dim=1)
        layout = AttentionLayout(positions=None, mask=block_causal_mask(end, block_size))
        out.append(network(sequence, layout=layout)[:, start:end])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_vectorized_logits_equal_the_naive_block_loop(block_size):
    network = _network()
    generator = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, 11, (3, 16), generator=generator)
    z = torch.where(torch.rand(3, 16, generator=generator) < 0.5, 11, x0)
    vectorized = network(z, clean=x0, block_size=block_size)
    naive = _naive_block_logits(network, z, x0, block_size)
    torch.testing.assert_close(vectorized, naive, rtol=0, atol=1e-10)
    # and the prediction of block b really does not see the clean copy of block b or later
    changed = x0.clone()
    changed[:, block_size:] = (changed[:, block_size:] + 1) % 11
    first = network(z, clean=changed, block_size=block_size)[:, :block_size]
    torch.testing.assert_close(first, vectorized[:, :block_size], rtol=0, atol=1e-12)


def test_dense_mask_is_the_rule_of_the_paper():
    mask = dense_block_mask(4, 2)
    noisy_noisy, noisy_clean = mask[:4, :4], mask[:4, 4:]
    clean_noisy, clean_clean = mask[4:, :4], mask[4:, 4:]
    block_diagonal = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(noisy_noisy, block_diagonal)
    assert torch.equal(noisy_clean, torch.tensor([[0, 0, 0, 0]] * 2 + [[1, 1, 0, 0]] * 2, dtype=torch.bool))
    assert not clean_noisy.any()
    assert torch.equal(clean_clean, block_causal_mask(4, 2))


def _flex_pattern(block_mask, rows: int) -> torch.Tensor:
    """Which keys each query attends through FlexAttention with ``block_mask``: equal scores
    (q = k = 0) and one-hot values, so the output row is uniform over the attended keys."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, rows, 16, dtype=torch.float64)
    values = torch.eye(rows, dtype=torch.float64)[None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the CPU reference path
        out = flex_attention(q, q, values, block_mask=block_mask)
    return out[0, 0] > 0


@pytest.mark.parametrize("length,block_size", [(16, 4), (100, 4), (192, 16), (160, 1)])
def test_flex_block_mask_equals_the_dense_mask_entry_for_entry(length, block_size):
    """2L = 32 (one partial tile), 200 (tiles of 128 cut mid-block), 384, 320 (block size 1)."""
    dense = dense_block_mask(length, block_size)
    block_mask = flex_block_mask(length, block_size, "cpu")
    assert block_mask.BLOCK_SIZE == (FLEX_TILE, FLEX_TILE)
    assert torch.equal(_flex_pattern(block_mask, 2 * length), dense)


def test_flex_and_dense_forwards_agree():
    network = _network(length=32)
    x0 = torch.randint(0, 11, (2, 32), generator=torch.Generator().manual_seed(3))
    z = torch.where(torch.arange(32) % 3 == 0, 11, x0)
    dense = network(z, clean=x0, block_size=8)
    network.block_attention = "flex"
    with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no backward on CPU
        warnings.simplefilter("ignore")
        flex = network(z, clean=x0, block_size=8)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-10)

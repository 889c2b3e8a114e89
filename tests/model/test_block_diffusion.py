"""Block diffusion (BD3-LM, ``model.block_diffusion``): the bound (docs/math.md#block-diffusion).

Block size L must be MDLM's estimate draw for draw; the block times are stratified over the
global batch; and with exact conditionals the bound must equal -log p(x) for block sizes 1, 2
and L. Its attention masks: test_block_attention; its sampler: sampling/test_blocks; its
training: tests/pipeline/training/test_block_diffusion_training.py.
"""

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion, block_times, spread_over_blocks
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig

VOCAB, LENGTH = 3, 4
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
Z_LIMIT = 4.0  # |estimate - truth| / standard error; deterministic seeds


def _network(length: int = 16, vocab: int = 11, **overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=32, n_heads=4, max_seq_len=length, **overrides)
    return Transformer(config).double().eval()


def test_a_block_of_the_whole_length_is_the_mdlm_estimate():
    network = _network(length=16)
    schedule = make_schedule("linear")
    x0 = torch.randint(0, 11, (6, 16), generator=torch.Generator().manual_seed(4))
    t = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mdlm = AbsorbingDiffusion(schedule, 11).nelbo_terms(network, x0, t, torch.Generator().manual_seed(6))
    block = BlockDiffusion(schedule, 11, 16).nelbo_terms(network, x0, t, torch.Generator().manual_seed(6))
    assert torch.equal(block.num_masked, mdlm.num_masked)  # the same masks, draw for draw
    for name in ("diffusion", "reconstruction", "prior"):
        torch.testing.assert_close(getattr(block, name), getattr(mdlm, name), rtol=0, atol=1e-10)


def test_block_times_are_stratified_over_the_global_batch():
    whole = block_times(8, 4, torch.Generator().manual_seed(0))
    parts = torch.cat([block_times(2, 4, torch.Generator().manual_seed(0), offset=o, global_batch_size=8)
                       for o in range(0, 8, 2)])
    assert torch.equal(whole, parts)
    assert torch.allclose(whole.flatten().sort().values.diff(), torch.full((31,), 1 / 32, dtype=torch.float64))
    spread = spread_over_blocks(torch.tensor([0.9], dtype=torch.float64), 4)
    torch.testing.assert_close(spread, torch.tensor([[0.9, 0.15, 0.4, 0.65]], dtype=torch.float64))


# ------------------------------------------------------------------ the bound, against exact conditionals
@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_monte_carlo_block_nelbo_matches_minus_log_likelihood(oracle, block_size):
    """E[NELBO] = -log p(x) within its standard error (the endpoint guard's terms are < 4 eps L log V)."""
    schedule = make_schedule("linear")
    process = BlockDiffusion(schedule, VOCAB, block_size)
    order = oracle.probs.argsort(descending=True)
    sequences = oracle.sequences[order[[0, 3, 20, 70]]]
    repeats = 6_000
    batch = sequences.repeat(repeats, 1)
    estimates = process.nelbo(oracle, batch, generator=torch.Generator().manual_seed(7)).view(repeats, -1)
    mean, standard_error = estimates.mean(0), estimates.std(0) / math.sqrt(repeats)
    truth = -oracle.log_prob(sequences)
    endpoint = 4 * schedule.endpoint_eps * LENGTH * math.log(VOCAB)
    assert ((mean - truth).abs() / (standard_error + endpoint)).max() < Z_LIMIT

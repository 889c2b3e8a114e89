"""Document masking (``model.documents``, ``TransformerConfig.document_separator``): the masked
forward of a packed sequence equals running each of its documents alone (float64), under every
process's noise and the autoregressive input, and on block diffusion's [z ; x] rows; a masked
separator splits nothing; FlexAttention's mask is the dense mask entry for entry."""

import itertools
import warnings
from dataclasses import replace

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_attention import AttentionLayout, KVCache, block_causal_mask
from model.documents import (
    block_document_starts,
    causal_mask_mod,
    dense_document_mask,
    document_starts,
    flex_document_mask,
)
from model.learned import LearnedDiffusion, LearnedSchedule
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from model.uniform import UniformDiffusion

VOCAB, SEP, LENGTH = 11, 10, 32
# Four documents, each ended by SEP but the last, which the window cuts.
DOCUMENTS = (5, 9, 3, 15)


def _network(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, max_seq_len=LENGTH,
                               document_separator=SEP, **overrides)
    return Transformer(config).double().eval()


def _unmasked(network: Transformer) -> Transformer:
    """The same weights without document masking: what runs each document alone."""
    plain = Transformer(replace(network.config, document_separator=None)).double().eval()
    plain.load_state_dict(network.state_dict())
    return plain


def _packed(batch: int = 3, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        parts = [torch.cat([torch.randint(0, SEP, (n - 1,), generator=generator), torch.tensor([SEP])])
                 for n in DOCUMENTS]
        rows.append(torch.cat(parts)[:LENGTH])
    return torch.stack(rows)


def _segments(tokens: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document of ``tokens``: a separator ends its document."""
    bounds = [0] + [i + 1 for i, token in enumerate(tokens[:-1]) if token == SEP] + [len(tokens)]
    return list(itertools.pairwise(bounds))


def _each_document_alone(plain: Transformer, z: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(*z.shape, VOCAB, dtype=torch.float64)
    for row in range(z.shape[0]):
        for start, end in _segments(z[row].tolist()):
            out[row, start:end] = plain(z[row:row + 1, start:end], None if t is None else t[row:row + 1])[0]
    return out


def _noised(process: str, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z_t of ``process`` at t = 0.3 (some separators masked or replaced, most visible)."""
    t = torch.full((x0.shape[0],), 0.3, dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    if process == "absorbing":
        diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    elif process == "uniform":
        diffusion = UniformDiffusion(make_schedule("linear"), VOCAB)
    else:
        diffusion = LearnedDiffusion(LearnedSchedule(VOCAB), VOCAB)
    return diffusion.corrupt(x0, t, generator), t


@pytest.mark.parametrize("process,time_conditioning", [("absorbing", False), ("uniform", True), ("learned", True)])
def test_masked_forward_equals_each_document_alone(process, time_conditioning):
    network = _network(time_conditioning=time_conditioning)
    x0 = _packed()
    z, t = _noised(process, x0)
    masked_separators = ((x0 == SEP) & (z != SEP)).sum()
    if process != "uniform":
        assert masked_separators > 0 and (z == SEP).sum() > 0  # both kinds of separator are exercised
    t = t if time_conditioning else None
    torch.testing.assert_close(network(z, t), _each_document_alone(_unmasked(network), z, t), rtol=0, atol=1e-10)


def test_autoregressive_forward_equals_each_document_alone():
    network = _network(causal=True)
    x0 = _packed()
    inputs = torch.cat([torch.full((3, 1), VOCAB), x0[:, :-1]], dim=1)  # model.autoregressive's input
    torch.testing.assert_close(network(inputs), _each_document_alone(_unmasked(network), inputs, None),
                               rtol=0, atol=1e-10)


def _block_documents_alone(plain: Transformer, z: torch.Tensor, x0: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block b of each row: the naive forward of (x^<b, z^b), cut into its documents, each run
    alone (block-causal over its rows' blocks, positions from 0)."""
    out = torch.empty(*z.shape, VOCAB, dtype=torch.float64)
    for row in range(z.shape[0]):
        for first in range(0, LENGTH, block_size):
            sequence = torch.cat([x0[row, :first], z[row, first:first + block_size]])
            for start, end in _segments(sequence.tolist()):
                if end <= first:
                    continue
                blocks = torch.arange(start, end) // block_size
                layout = AttentionLayout(None, blocks[None, :] <= blocks[:, None])
                logits = plain(sequence[None, start:end], layout=layout)[0]
                keep = max(first, start)
                out[row, keep:end] = logits[keep - start:]
    return out


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_block_forward_equals_each_document_alone(block_size):
    network = _network()
    x0 = _packed()
    z, _ = _noised("absorbing", x0)
    expected = _block_documents_alone(_unmasked(network), z, x0, block_size)
    torch.testing.assert_close(network(z, clean=x0, block_size=block_size), expected, rtol=0, atol=1e-10)


def test_block_sampler_without_cache_sees_what_training_saw():
    """The block sampler's forward of (x^<b, z^b) (a block-causal layout, documents read from
    its rows) gives block b the logits of the training forward over [z ; x]."""
    network, block_size = _network(), 8
    x0 = _packed()
    z, _ = _noised("absorbing", x0)
    trained = network(z, clean=x0, block_size=block_size)
    for first in range(0, LENGTH, block_size):
        end = first + block_size
        sequence = torch.cat([x0[:, :first], z[:, first:end]], dim=1)
        layout = AttentionLayout(None, block_causal_mask(end, block_size))
        torch.testing.assert_close(network(sequence, layout=layout)[:, first:], trained[:, first:end],
                                   rtol=0, atol=1e-10)


def test_a_document_masked_block_model_samples_without_its_kv_cache():
    """`unmask sample` asks for the KV cache; a network that reads its documents from its rows
    recomputes the window instead, and draws what the uncached sampler draws."""
    from model.block_diffusion import BlockDiffusion
    from model.sampling import SamplingPlan, sample_generators

    network, process = _network(), BlockDiffusion(make_schedule("linear"), VOCAB, 8)
    plan = SamplingPlan(sampler="first-hitting", seed=0)
    drawn = {}
    for kv_cache in (True, False):
        with torch.no_grad():
            drawn[kv_cache], _ = process.sample(network, plan, num_samples=2, seq_len=LENGTH, kv_cache=kv_cache,
                                                generator=sample_generators(plan.seed, range(2)))
    assert torch.equal(drawn[True], drawn[False]) and drawn[True].shape == (2, LENGTH)


def test_a_kv_cache_is_refused():
    network = _network()
    with pytest.raises(ValueError, match="cannot apply to a KV cache"):
        network(_packed()[:, :8], layout=AttentionLayout(None, None, KVCache()))


def test_documents_start_after_visible_separators_only():
    mask_id = VOCAB
    tokens = torch.tensor([[1, SEP, 2, 3, SEP, 4, mask_id, 5, SEP]])
    assert document_starts(tokens, SEP).tolist() == [[0, 0, 2, 2, 2, 5, 5, 5, 5]]
    masked = tokens.clone()
    masked[0, 4] = mask_id  # a masked separator splits nothing
    assert document_starts(masked, SEP).tolist() == [[0, 0, 2, 2, 2, 2, 2, 2, 2]]


def test_block_rows_read_the_clean_prefix_and_the_blocks_own_separators():
    mask_id = VOCAB
    clean = torch.tensor([[1, SEP, 2, 3, SEP, 4, 5, 6]])
    z = torch.tensor([[1, mask_id, 2, 3, mask_id, 4, SEP, 6]])
    starts = block_document_starts(z, clean, SEP, block_size=4)
    # noisy block 0 sees no separator (z[1] is masked); block 1 goes on with the document x^<1
    # left open at 2 (its own separator x[4] is masked in z) and splits after its visible z[6];
    # the clean half reads x.
    assert starts.tolist() == [[0, 0, 0, 0, 2, 2, 2, 7] + [0, 0, 2, 2, 2, 5, 5, 5]]


def test_the_separator_must_be_a_clean_token():
    with pytest.raises(ValueError, match="document_separator"):
        TransformerConfig(vocab_size=VOCAB, document_separator=VOCAB)


def _flex_pattern(block_mask, rows: int, batch: int) -> torch.Tensor:
    """Which keys each query attends through FlexAttention, per sequence [B, 1, rows, rows]:
    equal scores and one-hot values, so an output row is uniform over the attended keys."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(batch, 1, rows, 16, dtype=torch.float64)
    values = torch.eye(rows, dtype=torch.float64).expand(batch, 1, rows, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the CPU reference path
        return flex_attention(q, q, values, block_mask=block_mask) > 0


@pytest.mark.parametrize("rows,causal", [(32, False), (200, False), (200, True)])
def test_flex_document_mask_equals_the_dense_mask_entry_for_entry(rows, causal):
    """200 rows: tiles of 128 cut mid-document; documents of random lengths per sequence."""
    tokens = torch.randint(0, 8, (2, rows), generator=torch.Generator().manual_seed(4))
    starts = document_starts(tokens, 0)
    rule = causal_mask_mod if causal else None
    dense = dense_document_mask(starts, rule)
    block_mask = flex_document_mask(starts, rule)
    assert torch.equal(_flex_pattern(block_mask, rows, batch=2), dense)


@pytest.mark.parametrize("kind", ["mdlm", "blocks", "autoregressive"])
def test_flex_and_dense_forwards_agree(kind):
    network = _network(causal=kind == "autoregressive")
    x0 = _packed()
    z, _ = _noised("absorbing", x0)
    options = {"clean": x0, "block_size": 8} if kind == "blocks" else {}
    inputs = x0 if kind == "autoregressive" else z
    dense = network(inputs, **options)
    network.block_attention = "flex"
    with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no backward on CPU
        warnings.simplefilter("ignore")
        flex = network(inputs, **options)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-10)

"""torch.compile of the network (``Transformer.compile_parts``, ``CompiledCrossEntropy``), proved
on CPU: no graph break in a block or in the head with its loss, two graphs over fifty steps of
varying mask counts, and the eager loss and gradients.

Compilation here uses dynamo's counting backends ("eager", "aot_eager": graphs captured, AOT
autograd's backward included, no inductor code generation), so the tests stay fast. The trainer's
own compile under inductor (``prepare_model``) is tested in ``test_engine.py``; when evaluation
and sampling compile, in ``tests/evaluation/test_inference.py``."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from model.absorbing import AbsorbingDiffusion
from model.cross_entropy import CompiledCrossEntropy
from model.schedules import make_schedule
from model.transformer import ROW_MULTIPLE
from tests.support.small_networks import loss_and_named_grads as _loss_and_grads
from tests.support.small_networks import small_network, token_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH, WIDTH, BATCH = 37, 64, 32, 4
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, BATCH, LENGTH)

PADDED = 16  # vocab_multiple of the padded networks: 37 -> 48 logit columns, 38 -> 48 embedding rows


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_a_block_and_the_head_with_its_loss_compile_without_graph_breaks(time_conditioning):
    net = _net(time_conditioning=time_conditioning, vocab_multiple=PADDED)
    x, t = torch.randn(2, LENGTH, WIDTH), torch.rand(2)
    explained = torch._dynamo.explain(net.blocks[0])(x, net._condition(x[..., 0].long(), t))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    loss = CompiledCrossEntropy(net._padded_logits, ROW_MULTIPLE, backend="eager")
    hidden = torch.randn(2 * ROW_MULTIPLE, WIDTH, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2 * ROW_MULTIPLE,))
    for name, function in loss.functions.items():
        for tensor in (hidden, targets):  # as CompiledCrossEntropy marks them
            torch._dynamo.mark_dynamic(tensor, 0)
        explained = torch._dynamo.explain(function)(hidden, targets)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, explained.break_reasons)


@pytest.mark.parametrize("chunk_rows", [0, 48])
def test_fifty_steps_of_varying_mask_counts_compile_two_graphs(chunk_rows):
    """One graph for the blocks (all of them), one for the head and loss, whatever the number
    of masked rows: from none (t = 0) to every position (t near 1)."""
    torch._dynamo.reset()
    net = _net(vocab_multiple=PADDED)
    counter = CompileCounterWithBackend("aot_eager")
    net.compile_parts(backend=counter)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False, cross_entropy_chunk_rows=chunk_rows)
    x0, counts = _batch(), set()
    for step in range(50):
        t = torch.full((BATCH,), step / 49, dtype=torch.float64)  # 0 to 1: none to all of the 256 positions
        terms = diffusion.nelbo_terms(net, x0, t, torch.Generator().manual_seed(100 + step), reconstruction="uniform")
        terms.total.sum().backward()
        counts.add(int(terms.num_masked.sum()))
    assert 0 in counts and len(counts) >= 40 and max(counts) > 3 * ROW_MULTIPLE  # the row count did vary
    assert counter.frame_count == 2
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("chunk_rows", [0, 48])
def test_the_compiled_loss_and_gradients_are_the_eager_ones(chunk_rows):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=chunk_rows)
    eager, compiled, x0 = _net(vocab_multiple=PADDED), _net(vocab_multiple=PADDED), _batch()
    torch._dynamo.reset()
    compiled.compile_parts(backend="aot_eager")
    loss, grads = _loss_and_grads(eager, diffusion, x0)
    compiled_loss, compiled_grads = _loss_and_grads(compiled, diffusion, x0)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)

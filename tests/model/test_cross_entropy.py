"""The cross-entropy of the masked positions (``model.cross_entropy``): chunked or in one shot,
computed by the network from its hidden states or by the loss from its logits, over the masked
rows only or picked from every position's logits: the same loss and gradients. Chunking keeps no
[rows, vocabulary] logits for the backward."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from model.absorbing import AbsorbingDiffusion
from model.cross_entropy import chunked_cross_entropy
from model.schedules import make_schedule
from model.transformer import Transformer
from tests.support.small_networks import VOCAB, small_network, token_batch
from tests.support.small_networks import loss_and_ordered_grads as _nelbo_and_grads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH = 12
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, 4, LENGTH)


# ------------------------------------------------------------------ chunked cross-entropy
@pytest.mark.parametrize("chunk_rows", [1, 4, 10, 64])
def test_chunked_cross_entropy_equals_the_one_shot_loss_and_gradients(chunk_rows):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (10,), generator=generator)
    project = lambda h: F.linear(h, weight)  # noqa: E731

    one_shot = F.cross_entropy(project(hidden).float(), targets, reduction="none")
    expected = torch.autograd.grad(one_shot.sum(), [hidden, weight])
    chunked = chunked_cross_entropy(hidden, targets, project, chunk_rows)
    got = torch.autograd.grad(chunked.sum(), [hidden, weight])

    assert chunked.dtype == torch.float32 and chunked.shape == (10,)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-6, atol=0)
    for grad, reference in zip(got, expected):  # a chunk's matmul may sum in another order
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_keeps_no_logits_for_the_backward():
    """What autograd keeps between forward and backward: the one-shot path keeps the
    float32 log-softmax of every row ([N, V]); the chunked path keeps nothing that large."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    targets = torch.randint(0, VOCAB, (64,))
    project = lambda h: F.linear(h, weight)  # noqa: E731

    def largest_saved(loss_fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss_fn().sum().backward()
        return max(sizes, default=0)

    assert largest_saved(lambda: F.cross_entropy(project(hidden), targets, reduction="none")) == 64 * VOCAB
    assert largest_saved(lambda: chunked_cross_entropy(hidden, targets, project, 8)) < 64 * VOCAB / 4


def test_chunked_cross_entropy_handles_no_rows_and_refuses_a_bad_chunk():
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    empty = chunked_cross_entropy(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long),
                                  lambda h: F.linear(h, weight), 4)
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
        chunked_cross_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), lambda h: h, 0)


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_transformer_returns_the_nll_of_its_own_logits(time_conditioning):
    net = _net(time_conditioning=time_conditioning)
    z, t = _batch(), torch.rand(4)
    mask = torch.rand(4, LENGTH, generator=torch.Generator().manual_seed(3)) < 0.5
    targets = _batch()[mask]
    expected = F.cross_entropy(net(z, t, output_mask=mask).float(), targets, reduction="none")
    torch.testing.assert_close(net(z, t, output_mask=mask, targets=targets, chunk_rows=3), expected,
                               rtol=1e-6, atol=0)
    # Without an output mask: one NLL per position.
    full = net(z, t, targets=_batch(), chunk_rows=5)
    torch.testing.assert_close(full, F.cross_entropy(net(z, t).float().transpose(1, 2), _batch(), reduction="none"),
                               rtol=1e-6, atol=0)


def test_chunked_nelbo_has_the_loss_and_gradients_of_the_default_path():
    net, x0 = _net(), _batch()
    schedule = make_schedule("linear")
    loss, grads = _nelbo_and_grads(net, AbsorbingDiffusion(schedule, VOCAB), x0)
    chunked_loss, chunked_grads = _nelbo_and_grads(net, AbsorbingDiffusion(schedule, VOCAB, cross_entropy_chunk_rows=5),
                                                   x0)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=0)
    for grad, reference in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_chunking_leaves_denoisers_without_targets_to_the_logits_path():
    """An oracle or any (z, t) -> logits callable keeps working under a chunked diffusion."""
    logits = torch.randn(VOCAB)
    denoiser = lambda z, t: logits.expand(*z.shape, -1)  # noqa: E731
    x0 = _batch()
    chunked = AbsorbingDiffusion(make_schedule("cosine"), VOCAB, cross_entropy_chunk_rows=2)
    default = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    assert torch.equal(chunked.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(0)),
                       default.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="cross_entropy_chunk_rows must be an int >= 0"):
        AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=-1)


# ------------------------------------------------------------------ the masked rows
class _FullLogits(torch.nn.Module):
    """A Transformer behind a plain forward (not a ``Denoiser``): the loss then asks for
    every position's logits and picks the masked rows itself."""

    def __init__(self, net: Transformer) -> None:
        super().__init__()
        self.net = net

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(z, t)


def test_logits_at_masked_positions_only_give_the_loss_of_the_full_logits():
    net, x0 = _net(), _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _nelbo_and_grads(net, diffusion, x0)
    full_loss, full_grads = _nelbo_and_grads(_FullLogits(net), diffusion, x0)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    for grad, reference in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-7)

"""A vocabulary padded to a multiple of ``model.vocab_multiple`` (``TransformerConfig``): the
padded network gives the true loss, logits and gradients (its padding rows and columns never
count), for the absorbing and the uniform process, and exports the unpadded tensors."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.transformer import parameter_counts, unpadded_state
from tests.support.small_networks import loss_and_named_grads as _loss_and_grads
from tests.support.small_networks import small_network, token_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH, BATCH = 37, 64, 4
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, BATCH, LENGTH)

PADDED = 16  # vocab_multiple of the padded networks: 37 -> 48 logit columns, 38 -> 48 embedding rows

HEADS = {"tied": {}, "untied": {"tie_weights": False},
         "untied+bias+mask row": {"tie_weights": False, "head_bias": True, "head_mask_row": True}}


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("chunk_rows", [0, 5])
def test_a_padded_vocabulary_gives_the_true_loss_logits_and_gradients(head, chunk_rows):
    plain, padded = _net(**HEADS[head]), _net(vocab_multiple=PADDED, **HEADS[head])
    assert padded.embed.weight.shape[0] == 48 and padded.config.logit_columns == 48
    # The same draws: every true row and every other weight is the unpadded network's, the padding 0.
    padded_state = padded.state_dict()
    for name, tensor in plain.state_dict().items():
        rows = tensor.shape[0] if tensor.dim() else 0
        assert torch.equal(padded_state[name][:rows], tensor) and not padded_state[name][rows:].any(), name
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=chunk_rows)
    x0 = _batch()
    loss, grads = _loss_and_grads(plain, diffusion, x0)
    padded_loss, padded_grads = _loss_and_grads(padded, diffusion, x0)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        rows = grad.shape[0]
        torch.testing.assert_close(padded_grads[name][:rows], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert not padded_grads[name][rows:].any(), f"{name}: a padded row got a gradient"
    with torch.no_grad():
        logits = padded(x0)
    assert logits.shape == (BATCH, LENGTH, VOCAB)
    torch.testing.assert_close(logits, plain(x0).detach(), rtol=1e-6, atol=1e-6)
    # What an export holds: the unpadded network's tensors, which load into it.
    unpadded = unpadded_state(padded.state_dict(), padded.config)
    assert {name: tuple(t.shape) for name, t in unpadded.items()} == \
        {name: tuple(t.shape) for name, t in plain.state_dict().items()}
    assert parameter_counts(padded.config).total == sum(p.numel() for p in padded.parameters())


def test_the_uniform_process_scores_a_padded_network_as_the_true_one():
    """The uniform bound uses the whole prediction over the vocabulary: it must see V columns."""
    from model.uniform import UniformDiffusion

    plain, padded = _net(time_conditioning=True), _net(time_conditioning=True, vocab_multiple=PADDED)
    diffusion = UniformDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _loss_and_grads(plain, diffusion, _batch())
    padded_loss, padded_grads = _loss_and_grads(padded, diffusion, _batch())
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    assert not padded_grads["embed.weight"][VOCAB + 1:].any()

"""The small network of the tests that compute one loss two ways (compiled or eager, chunked or
not, padded or not, one attention kernel or another), and the loss and gradients of a batch.

37 tokens, 2 layers of width 32 with 4 heads, initialized from seed 0; each test module builds
it at its own sequence length."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.transformer import Transformer, TransformerConfig

VOCAB, WIDTH = 37, 32


def small_network(max_seq_len: int, **overrides) -> Transformer:
    """The network at ``max_seq_len`` (``overrides`` set other fields), from torch's seed 0."""
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=WIDTH, n_heads=4,
                                         max_seq_len=max_seq_len, **overrides))


def token_batch(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Uniform random tokens [batch, length] of the vocabulary, drawn from ``seed``."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def loss_and_named_grads(network: torch.nn.Module, diffusion, x0: torch.Tensor, seed: int = 2
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``diffusion``'s loss per token of ``x0`` (times and masks drawn from ``seed``) and the
    gradients of ``network``'s parameters, by name."""
    network.zero_grad(set_to_none=True)
    loss = diffusion.nelbo(network, x0, generator=torch.Generator().manual_seed(seed)).sum() / x0.numel()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in network.named_parameters()}


def loss_and_ordered_grads(network: torch.nn.Module | Callable, diffusion, x0: torch.Tensor
                           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of a fixed batch (fixed times and masks) and the parameters' gradients, in
    parameter order (wrappers may rename parameters, never reorder them)."""
    network.zero_grad(set_to_none=True)
    loss = diffusion.nelbo(network, x0, generator=torch.Generator().manual_seed(2)).sum() / x0.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in network.parameters()]

"""The autoregressive baseline: exact next-token likelihood of a causal network.

The same ``Transformer`` with ``causal=True`` reads ``[start, x_0, ..., x_{L-2}]`` and
predicts ``x_0, ..., x_{L-1}``, so every token of a block is scored, as the diffusion bound
scores every token: the two numbers are comparable on the same data and tokenizer. The
start token is the id V, the row of the embedding that the diffusion model uses as mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from model.checks import check_token_ids, check_vocab_size

__all__ = ["Autoregressive", "CausalNetwork"]

# A causal network: (ids [B, L], None) -> next-token logits [B, L, V] (``Transformer`` with causal=True).
CausalNetwork = Callable[[Tensor, None], Tensor]


class Autoregressive:
    """Next-token objective over ``vocab_size`` tokens with start id ``vocab_size``."""

    def __init__(self, vocab_size: int, *, validate: bool = True) -> None:
        check_vocab_size(vocab_size)
        self.vocab_size = vocab_size
        self.validate = validate

    @property
    def start_id(self) -> int:
        return self.vocab_size

    def nll(self, network: CausalNetwork, x0: Tensor, positions: Tensor | None = None) -> Tensor:
        """Exact -log p(x0) per sequence in nats (float64) under a causal ``network``.

        ``positions`` (bool [B, L]) sums only the True tokens (the padding of a partial
        evaluation block follows the real tokens, so the model never conditions on it).
        """
        check_token_ids(x0, "x0", self.vocab_size - 1, check_values=self.validate)
        batch, length = x0.shape
        start = x0.new_full((batch, 1), self.start_id)
        logits = network(torch.cat([start, x0[:, :-1]], dim=1), None)
        if tuple(logits.shape) != (batch, length, self.vocab_size):
            raise ValueError(f"network returned logits of shape {tuple(logits.shape)}, "
                             f"expected {(batch, length, self.vocab_size)}")
        nll = F.cross_entropy(logits.float().flatten(0, 1), x0.flatten(), reduction="none")
        nll = nll.view(batch, length).to(torch.float64)
        if positions is not None:
            # where, not a product: a padding position's loss may be inf and must not become NaN.
            nll = torch.where(positions, nll, 0.0)
        return nll.sum(-1)

"""The denoiser interface: what the processes and the samplers ask of a network.

A denoiser is f(z_t, t) -> logits over the V clean tokens at every position (SUBS: no mask
logit). ``Denoiser`` answers ``logits`` (the only method to write), ``logits_at`` (at selected
positions only), ``nll_at`` (-log p of targets there; ``fused_nll``: without ever holding the
[N, V] logits) and ``time_independent`` (whether samplers may reuse an output across times).
``model.transformer.Transformer`` implements all four efficiently. A plain function
``(z_t, t) -> logits`` is a denoiser too (``as_denoiser``). The guide: docs/model-api.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

__all__ = ["Denoiser", "DenoiserFunction", "DenoiserLike", "FunctionDenoiser", "as_denoiser"]

DenoiserFunction = Callable[[Tensor, Tensor], Tensor]


class Denoiser(ABC):
    """A network predicting the clean tokens of z_t (docs/model-api.md).

    Calling a denoiser, ``denoiser(z_t, t)``, returns ``logits(z_t, t)``, so every
    denoiser is also the plain function of the manual's contract (docs/model-api.md).
    """

    @abstractmethod
    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        """Logits [B, L, V] over the clean tokens at every position of z_t [B, L], at times t [B]."""

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        """Logits [N, V] at the N True positions of ``selected`` (bool [B, L])."""
        return self.logits(z_t, t)[selected]

    def nll_at(self, z_t: Tensor, t: Tensor, selected: Tensor, targets: Tensor,
               chunk_rows: int | None = None) -> Tensor:
        """-log softmax(logits)[targets] in float32 [N] at the selected positions (targets: LongTensor [N]).

        This default holds the N rows of logits at once, whatever ``chunk_rows``: only a
        denoiser that computes the loss from its hidden states can chunk the projection.
        """
        return F.cross_entropy(self.logits_at(z_t, t, selected).float(), targets, reduction="none")

    @property
    def fused_nll(self) -> bool:
        """Whether ``nll_at`` computes the loss from the network's hidden states, never holding
        the [N, V] logits (then the bounds ask for it rather than for ``logits_at``)."""
        return False

    @property
    def time_independent(self) -> bool:
        """Whether the output depends on z_t alone (samplers may then reuse it across times)."""
        return False

    def __call__(self, z_t: Tensor, t: Tensor) -> Tensor:
        return self.logits(z_t, t)


class FunctionDenoiser(Denoiser):
    """A plain function ``(z_t, t) -> logits [B, L, V]`` as a ``Denoiser``.

    ``time_independent=True`` declares that the function ignores t (its outputs may be
    reused by the samplers); the default assumes it does not.
    """

    def __init__(self, function: DenoiserFunction, *, time_independent: bool = False) -> None:
        self.function = function
        self._time_independent = time_independent

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        return self.function(z_t, t)

    @property
    def time_independent(self) -> bool:
        return self._time_independent


DenoiserLike = Denoiser | DenoiserFunction


def as_denoiser(denoiser: DenoiserLike) -> Denoiser:
    """The denoiser itself, or a plain function wrapped in a (time-dependent) ``FunctionDenoiser``."""
    return denoiser if isinstance(denoiser, Denoiser) else FunctionDenoiser(denoiser)

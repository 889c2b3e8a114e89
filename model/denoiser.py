"""The denoiser interface: what the processes and the samplers ask of a network.

MATH.md's denoiser is a function f(z_t, t) -> logits over the V clean tokens at every
position (SUBS: no mask logit). The bounds need f only at some positions (the masked ones),
and the training loss only -log softmax(f)[x] there; a network can compute those for much
less than all the logits: the output projection is the largest matmul at GPT-2 sizes, and
the float32 logits of every scored token the largest activation of the loss. A
``Denoiser`` answers four questions:

- ``logits(z_t, t)``: logits [B, L, V] at every position (the samplers);
- ``logits_at(z_t, t, selected)``: logits [N, V] at the N positions where ``selected``
  (bool [B, L]) is True, in row-major order;
- ``nll_at(z_t, t, selected, targets, chunk_rows)``: -log softmax(f)[targets], [N], in float32
  at those positions, with at most ``chunk_rows`` rows of logits alive at a time (None: all);
  ``fused_nll`` says whether it computes them without the [N, V] logits (from the network's
  hidden states), in which case the bounds always ask for it;
- ``time_independent``: whether the output depends on z_t alone, so that a sampler may reuse
  an output computed at another time (MDLM's caching).

Only ``logits`` must be written: the others default to selecting rows of it, to "not
fused" and to "depends on t". ``model.transformer.Transformer`` implements all four efficiently. A plain
function ``(z_t, t) -> logits`` is a denoiser too: every process and sampler takes one and
adapts it with ``as_denoiser``; wrap it in ``FunctionDenoiser`` to declare it time-independent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

__all__ = ["Denoiser", "DenoiserFunction", "DenoiserLike", "FunctionDenoiser", "as_denoiser"]

DenoiserFunction = Callable[[Tensor, Tensor], Tensor]


class Denoiser(ABC):
    """A network predicting the clean tokens of z_t; see the module docstring.

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

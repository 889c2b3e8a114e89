"""Cross-entropy through the output head, optionally in chunks of rows: no [N, V] float32 logits kept.

``chunked_cross_entropy(hidden, targets, project, chunk_rows)`` is -log softmax(project(h_n))[x_n]
per scored row, the log-softmax in float32. With ``chunk_rows`` it runs the same ops on that
many rows at a time, each chunk under activation checkpointing, so the head's memory is bounded
by chunk_rows x V whatever N (the loss agrees with the one-shot path to float rounding; one more
forward projection of the head). ``CompiledCrossEntropy`` is the same computation under
``torch.compile``, rows padded to a multiple of ``row_multiple`` with ignored targets so that one
graph serves every row count. Why and what it costs: docs/model-api.md#the-cross-entropy-through-the-head.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.checks import check_positive_int

__all__ = ["CompiledCrossEntropy", "chunked_cross_entropy", "rows_cross_entropy"]

Projection = Callable[[Tensor], Tensor]
# A target that scores exactly 0 with a zero gradient (F.cross_entropy's default ignore_index).
IGNORE_INDEX = -100


def chunked_cross_entropy(hidden: Tensor, targets: Tensor, project: Projection, chunk_rows: int | None) -> Tensor:
    """-log softmax(project(hidden))[targets] per row, float32, of the shape of ``targets``.

    ``hidden`` is [..., d] with leading shape that of ``targets`` (LongTensor of class ids);
    ``project`` maps [n, d] to logits [n, V] (the output head). At most ``chunk_rows`` rows
    of logits exist at a time, in the forward and in the backward; None: every row at once.
    """
    rows, flat_targets = _flat(hidden, targets)
    if chunk_rows is None:
        return rows_cross_entropy(project, rows, flat_targets).view(targets.shape)
    check_positive_int("chunk_rows", chunk_rows)
    # Without autograd nothing is kept for a backward: chunking alone bounds the memory.
    nll = _checkpointed_rows_nll if torch.is_grad_enabled() else rows_cross_entropy
    pieces = [nll(project, chunk, chunk_targets)
              for chunk, chunk_targets in zip(rows.split(chunk_rows), flat_targets.split(chunk_rows))]
    return torch.cat(pieces).view(targets.shape)


def rows_cross_entropy(project: Projection, hidden: Tensor, targets: Tensor) -> Tensor:
    """The one-shot path: -log softmax(project(hidden))[targets] per row [n], log-softmax in
    float32 even for bf16 logits; a target ``IGNORE_INDEX`` scores exactly 0."""
    return F.cross_entropy(project(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def _checkpointed_rows_nll(project: Projection, hidden: Tensor, targets: Tensor) -> Tensor:
    # No randomness in the head: skip saving and restoring the RNG state.
    return checkpoint(rows_cross_entropy, project, hidden, targets, use_reentrant=False, preserve_rng_state=False)


def _flat(hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """hidden [..., d] and targets [...] as rows [n, d] and [n]."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share "
                         f"their leading shape")
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


class CompiledCrossEntropy:
    """``rows_cross_entropy`` (or chunked) through ``project`` under ``torch.compile``.

    The number of scored rows changes every micro-batch, so they are padded up to a multiple
    of ``row_multiple`` with rows whose target is ``IGNORE_INDEX`` (0 loss, 0 gradient) and
    the row dimension is marked dynamic: one graph serves every count, and the compiler never
    sees the sizes 0 and 1 it specializes on. ``compile_options`` go to ``torch.compile``
    (a test passes ``backend="eager"``).
    """

    def __init__(self, project: Projection, row_multiple: int, **compile_options: Any) -> None:
        check_positive_int("row_multiple", row_multiple)
        self.row_multiple = row_multiple
        # The functions compiled, by name (what a test hands torch._dynamo.explain).
        self.functions = {"one_shot": partial(rows_cross_entropy, project),
                          "checkpointed": partial(_checkpointed_rows_nll, project)}
        self._one_shot, self._checkpointed = (torch.compile(self.functions[name], **compile_options)
                                              for name in ("one_shot", "checkpointed"))

    def __call__(self, hidden: Tensor, targets: Tensor, chunk_rows: int | None = None) -> Tensor:
        """-log softmax(project(hidden))[targets], float32, of the shape of ``targets``; with
        ``chunk_rows``, at most that many rows (rounded up to ``row_multiple``) of logits at once."""
        rows, flat_targets = _flat(hidden, targets)
        count = rows.shape[0]
        step = count if not chunk_rows else chunk_rows
        nll = self._checkpointed if chunk_rows and torch.is_grad_enabled() else self._one_shot
        pieces = [nll(*self._padded(chunk, chunk_targets))[:chunk.shape[0]]
                  for chunk, chunk_targets in zip(rows.split(max(step, 1)), flat_targets.split(max(step, 1)))]
        return (torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)).view(targets.shape)

    def _padded(self, rows: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """rows [n, d] and targets [n] padded to [n', d] and [n'], n' the next multiple of
        ``row_multiple`` (at least one), the row dimension marked dynamic."""
        extra = -(-max(rows.shape[0], 1) // self.row_multiple) * self.row_multiple - rows.shape[0]
        rows, targets = F.pad(rows, (0, 0, 0, extra)), F.pad(targets, (0, extra), value=IGNORE_INDEX)
        for tensor in (rows, targets):
            torch._dynamo.mark_dynamic(tensor, 0)
        return rows, targets

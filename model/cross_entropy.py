"""Cross-entropy through the output head, in chunks of rows: no [N, V] float32 logits kept.

The training loss needs -log softmax(head(h_n))[x_n] at the N scored rows. Computed in one
go, the head's [N, V] logits, their float32 copy and the float32 log-softmax all exist at
once, and autograd keeps the log-softmax until the backward: with V = 50257 and 8192
masked tokens in a micro-batch that is 1.6 GB held per micro-batch, more than a GPT-2
medium block's activations.

``chunked_cross_entropy`` runs exactly the same ops (projection, float32 cast,
cross-entropy) on ``chunk_rows`` rows at a time, each chunk under non-reentrant activation
checkpointing: the forward keeps only the chunk's inputs (views of h), and the backward
recomputes one chunk's logits at a time. The head's memory is then bounded by
chunk_rows x V, whatever N; the price is one more forward projection of the head (a third
more head FLOPs). Each row's arithmetic is that of the one-shot path, so the loss agrees
with it to float rounding (bit for bit where the matmul's result does not depend on how
many rows it multiplies); the head weight's gradient is a sum of per-chunk products rather
than one product, equal up to float rounding.

``CompiledCrossEntropy`` is the same computation under ``torch.compile`` (the fp32 cast,
log-softmax and target pick fused into a few kernels). The number of scored rows changes
every micro-batch (it is the number of masked tokens), so the compiled function takes them
padded up to a multiple of ``row_multiple`` with rows whose target is ``ignore_index``
(exactly 0 loss and 0 gradient), and with that dimension marked dynamic: one graph serves
every count (rather than one graph per bucket of counts: no compile after the first steps,
and at most ``row_multiple - 1`` wasted rows), and the compiler never sees the sizes 0 and 1
it specializes on. Chunks, when asked for, go through the same graph under activation
checkpointing.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.checks import check_positive_int

__all__ = ["CompiledCrossEntropy", "chunked_cross_entropy", "rows_cross_entropy"]

Projection = Callable[[Tensor], Tensor]
# A target that scores exactly 0 with a zero gradient (F.cross_entropy's default ignore_index).
IGNORE_INDEX = -100


def chunked_cross_entropy(hidden: Tensor, targets: Tensor, project: Projection, chunk_rows: int) -> Tensor:
    """-log softmax(project(hidden))[targets] per row, float32, of the shape of ``targets``.

    ``hidden`` is [..., d] with leading shape that of ``targets`` (LongTensor of class ids);
    ``project`` maps [n, d] to logits [n, V] (the output head). At most ``chunk_rows`` rows
    of logits exist at a time, in the forward and in the backward.
    """
    check_positive_int("chunk_rows", chunk_rows)
    rows, flat_targets = _flat(hidden, targets)
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
    """``rows_cross_entropy`` (or chunked) through ``project`` under ``torch.compile``, rows
    padded to a multiple of ``row_multiple`` (module docstring). ``compile_options`` go to
    ``torch.compile`` (a test passes ``backend="eager"``)."""

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

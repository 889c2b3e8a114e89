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
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.checks import check_positive_int

__all__ = ["chunked_cross_entropy"]

Projection = Callable[[Tensor], Tensor]


def chunked_cross_entropy(hidden: Tensor, targets: Tensor, project: Projection, chunk_rows: int) -> Tensor:
    """-log softmax(project(hidden))[targets] per row, float32, of the shape of ``targets``.

    ``hidden`` is [..., d] with leading shape that of ``targets`` (LongTensor of class ids);
    ``project`` maps [n, d] to logits [n, V] (the output head). At most ``chunk_rows`` rows
    of logits exist at a time, in the forward and in the backward.
    """
    check_positive_int("chunk_rows", chunk_rows)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share "
                         f"their leading shape")
    rows, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    # Without autograd nothing is kept for a backward: chunking alone bounds the memory.
    recompute = torch.is_grad_enabled()
    pieces = []
    for chunk, chunk_targets in zip(rows.split(chunk_rows), flat_targets.split(chunk_rows)):
        if recompute:
            # No randomness in the head: skip saving and restoring the RNG state.
            pieces.append(checkpoint(_rows_nll, project, chunk, chunk_targets, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_rows_nll(project, chunk, chunk_targets))
    return torch.cat(pieces).view(targets.shape)


def _rows_nll(project: Projection, hidden: Tensor, targets: Tensor) -> Tensor:
    """The one-shot path on a few rows: log-softmax in float32 even for bf16 logits."""
    return F.cross_entropy(project(hidden).float(), targets, reduction="none")

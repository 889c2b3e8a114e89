"""Input contracts shared by the schedules, the processes, the sampler and the AR baseline.

Each check raises ValueError naming the argument and what it must be. Checks that read
values back (token ranges, times in [0, 1]) synchronize a GPU with the host, so the
callers that run in a training step skip them (``check_values=False``, the processes'
``validate=False``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_logits", "check_nll", "check_positions", "check_positive_int", "check_reconstruction",
           "check_row_times", "check_schedule_times", "check_token_ids", "check_vocab_size"]


def check_vocab_size(vocab_size: int) -> None:
    """At least two clean tokens (one would make every bound 0)."""
    if not (isinstance(vocab_size, int) and vocab_size >= 2):
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")


def check_positive_int(name: str, value: int) -> None:
    """A count such as ``steps``, ``num_samples`` or ``chunk_rows``: an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_token_ids(x: Tensor, name: str, max_id: int, *, check_values: bool = True) -> None:
    """Raise ValueError naming ``name`` unless x is a LongTensor [B, L] with ids in [0, max_id]."""
    if not isinstance(x, Tensor) or x.dtype != torch.long:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a LongTensor, got {got}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape [batch, length], got {tuple(x.shape)}")
    if check_values:
        low, high = int(x.min()), int(x.max())
        if low < 0 or high > max_id:
            raise ValueError(f"{name} holds token ids in [{low}, {high}], outside [0, {max_id}]")


def check_schedule_times(t: Tensor, name: str = "t") -> None:
    """Times of any shape handed to a schedule: floating point, in [0, 1]."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {type(t).__name__}"
                         + (f" of dtype {t.dtype}" if isinstance(t, Tensor) else ""))
    if t.numel() and not bool(((t >= 0) & (t <= 1)).all()):
        raise ValueError(f"{name} must lie in [0, 1]; got values in "
                         f"[{t.min().item():.6g}, {t.max().item():.6g}]")


def check_row_times(t: Tensor, batch: int, *, check_values: bool = True) -> None:
    """One diffusion time per sequence: floating point [batch], in [0, 1]."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise ValueError(f"t must be a floating-point tensor, got "
                         f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"t must have shape [{batch}] (one time per sequence), got {tuple(t.shape)}")
    if check_values and not bool(((t >= 0) & (t <= 1)).all()):
        raise ValueError(f"t must lie in [0, 1], got values in [{float(t.min())}, {float(t.max())}]")


def check_positions(positions: Tensor | None, x0: Tensor) -> None:
    """The scored positions (None: all) are a BoolTensor of the shape of x0."""
    if positions is None:
        return
    if not isinstance(positions, Tensor) or positions.dtype != torch.bool:
        got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise ValueError(f"positions must be a BoolTensor, got {got}")
    if positions.shape != x0.shape:
        raise ValueError(f"positions must have the shape of x0 {tuple(x0.shape)}, "
                         f"got {tuple(positions.shape)}")


def check_reconstruction(kind: str) -> None:
    if kind not in ("model", "uniform"):
        raise ValueError(f"reconstruction must be 'model' or 'uniform', got {kind!r}")


def check_logits(logits: Tensor, expected: tuple[int, ...], vocab_size: int) -> None:
    """A denoiser's output: floating-point logits of shape ``expected`` (last dim V, no mask logit)."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"denoiser must return floating-point logits, got {type(logits).__name__}")
    if tuple(logits.shape) != expected:
        raise ValueError(f"denoiser returned logits of shape {tuple(logits.shape)}, expected "
                         f"{expected} (logits over the {vocab_size} clean tokens, no mask logit)")


def check_nll(nll: Tensor, count: int) -> None:
    """A denoiser's ``nll_at``: float -log p of each of the ``count`` targets."""
    if not isinstance(nll, Tensor) or not nll.is_floating_point() or tuple(nll.shape) != (count,):
        got = tuple(nll.shape) if isinstance(nll, Tensor) else type(nll).__name__
        raise ValueError(f"denoiser called with targets returned {got}, expected float [{count}] "
                         f"(-log p of each target)")

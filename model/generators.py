"""Where the processes' random numbers come from: one generator per batch, or one per row.

``generator`` may be a single ``torch.Generator`` (or None, the global one) for the whole
batch, or a sequence of generators, one per row: row i then draws its uniforms from its
own generator (on that generator's device), so its masks do not depend on which other rows
share its batch. The zero-shot estimator uses this to make its result independent of batch
size and of the split over data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Generators", "batch_generator", "uniforms"]

Generators = torch.Generator | Sequence[torch.Generator] | None


def uniforms(shape: torch.Size | tuple[int, ...], generator: Generators, device: torch.device) -> Tensor:
    """float64 U[0, 1) of ``shape`` (rows first): from one generator, or row b from generator[b]."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, dtype=torch.float64, device=device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]} rows")
    # Each row on its own generator's device: a row's masks then do not depend on the device.
    rows = [torch.rand(shape[1:], generator=g, dtype=torch.float64, device=g.device) for g in generator]
    return torch.stack(rows).to(device)


def batch_generator(generator: Generators, drawn: str) -> torch.Generator | None:
    """The batch's one generator, for a draw the batch shares (``drawn``, e.g. its times)."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    raise ValueError(f"with one generator per row, pass {drawn} (the times are shared by the batch)")

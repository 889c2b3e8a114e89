"""Where random numbers come from: generators seeded by a hash of keys, and draws from one
generator per batch or one per row.

``seeded_generators`` is the one hash from keys (a seed, a step, a stream, a sample's index)
to generators: the trainer's times and masks, the bound estimator's streams and the samplers'
per-sample generators all come from it, so distinct keys give independent streams.

``generator`` may be a single ``torch.Generator`` (or None, the global one) for the whole
batch, or a sequence of generators, one per row: row i then draws its uniforms from its
own generator (on that generator's device), so its masks do not depend on which other rows
share its batch. The zero-shot estimator uses this to make its result independent of batch
size and of the split over data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["Generators", "batch_generator", "seeded_generators", "uniforms"]

Generators = torch.Generator | Sequence[torch.Generator] | None


def seeded_generators(entropy: int | Sequence[int], count: int = 1, *, spawn_key: Sequence[int] = (),
                      first: int = 0, device: torch.device | str = "cpu", seed_bits: int = 63) -> list[torch.Generator]:
    """Generators ``first`` to ``first + count - 1`` on ``device`` of the stream (``entropy``,
    ``spawn_key``): each seeded by one word of numpy's ``SeedSequence``. ``seed_bits`` 63 keeps
    every seed inside torch's signed range on any device; the bound estimator's CPU streams take
    the whole word (64)."""
    words = np.random.SeedSequence(entropy, spawn_key=tuple(spawn_key)).generate_state(first + count, np.uint64)
    return [torch.Generator(device=device).manual_seed(int(word >> (64 - seed_bits))) for word in words[first:]]


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

"""Denoisers for the process and sampler tests: arbitrary (not exact) predictions that depend on
the whole state, with or without the time, or one fixed distribution everywhere; each records
what it was asked. (The exact one is the oracle: ``tests.support.oracle``.)"""

from __future__ import annotations

import torch
from torch import Tensor

from model.denoiser import Denoiser


class TableDenoiser(Denoiser):
    """Random logits for every noisy state z in {0..V}^L (V = the mask): a prediction that
    depends on every visible token, like a network, and is not any distribution's
    conditionals. ``time_weight`` > 0 adds ``time_weight * t`` times a second table: a
    time-conditioned denoiser. Records (z, t) of every call."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, *, time_weight: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(seed)
        states = (vocab_size + 1) ** seq_len
        self.base = 2.0 * torch.randn(states, seq_len, vocab_size, generator=generator, dtype=torch.float64)
        self.slope = 2.0 * torch.randn(states, seq_len, vocab_size, generator=generator, dtype=torch.float64)
        self.vocab_size, self.seq_len, self.time_weight = vocab_size, seq_len, time_weight
        self.place = (vocab_size + 1) ** torch.arange(seq_len - 1, -1, -1)
        self.calls: list[tuple[Tensor, Tensor]] = []

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        self.calls.append((z_t.clone(), t.clone()))
        index = (z_t.cpu() * self.place).sum(-1)
        return self.base[index] + self.time_weight * t.cpu().to(torch.float64)[:, None, None] * self.slope[index]

    @property
    def time_independent(self) -> bool:
        return self.time_weight == 0.0


class ShapeRecorder(Denoiser):
    """Fixed per-position logits (``logits[L, V]``, cut to the input's length), time-free;
    records every input it is called with."""

    def __init__(self, logits: Tensor) -> None:
        self.table = logits.to(torch.float32)
        self.inputs: list[Tensor] = []

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        self.inputs.append(z_t.clone())
        return self.table[:z_t.shape[1]].expand(z_t.shape[0], -1, -1).clone()

    @property
    def time_independent(self) -> bool:
        return True


class ConstantDenoiser:
    """Predicts the same distribution at every position; counts its calls and times."""

    def __init__(self, probs: Tensor) -> None:
        self.logits = probs.log().float()
        self.calls: list[Tensor] = []

    def __call__(self, z: Tensor, t: Tensor) -> Tensor:
        self.calls.append(t.clone())
        return self.logits.expand(*z.shape, -1).clone()

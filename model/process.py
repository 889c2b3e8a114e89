"""The interface every diffusion process shares, and what its bounds return.

``DiffusionProcess`` is implemented by the absorbing process (``model.absorbing``), GenMD4's
learned schedules (``model.learned``) and uniform diffusion (``model.uniform``): the same
methods, arguments, randomness rules and input validation, so one trainer, evaluator and
sampler drive any of them. Every ``nelbo_terms`` has one shape: check the input, draw the
times, draw z_t, then the diffusion, reconstruction and prior terms of docs/math.md#the-bound.
``low_discrepancy_times`` draws the stratified times (docs/math.md#low-discrepancy-times).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from model.checks import (
    check_logits,
    check_positions,
    check_positive_int,
    check_row_times,
    check_token_ids,
    check_vocab_size,
)
from model.denoiser import DenoiserLike, as_denoiser
from model.generators import Generators, batch_generator
from model.sampling import (
    Sampler,
    SamplingPlan,
    SamplingStats,
    draw,
)

Reconstruction = Literal["model", "uniform"]

__all__ = ["DiffusionProcess", "NelboTerms", "Reconstruction", "low_discrepancy_times"]


def low_discrepancy_times(
    batch_size: int,
    generator: torch.Generator | None = None,
    *,
    offset: int = 0,
    global_batch_size: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Stratified times ``t_i = (u + (offset + i) / G) mod 1`` for i < batch_size (float64).

    One uniform ``u`` is shared by the whole global batch of size ``G``; each slice of it
    (a rank, a micro-batch) passes its ``offset`` into that batch. To stratify over the
    global batch of a data-parallel step, seed ``generator`` identically on every rank
    (for example from the step number) and give each micro-batch its own offset; draw the
    masks from a per-rank generator. Each t_i is marginally U[0, 1), so estimates stay
    unbiased, while the batch covers [0, 1) evenly (lower variance than i.i.d. times).
    """
    global_batch_size = batch_size if global_batch_size is None else global_batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= offset <= global_batch_size - batch_size:
        raise ValueError(f"offset={offset} with batch_size={batch_size} does not fit in "
                         f"global_batch_size={global_batch_size}")
    gen_device = generator.device if generator is not None else device
    u = torch.rand((), generator=generator, dtype=torch.float64, device=gen_device)
    index = torch.arange(offset, offset + batch_size, dtype=torch.float64, device=gen_device)
    return torch.remainder(u + index / global_batch_size, 1.0).to(device or gen_device)


@dataclass(frozen=True)
class NelboTerms:
    """The parts of a one-sample NELBO estimate, per sequence, in nats (float64)."""

    t: Tensor               # [B] the diffusion times used
    diffusion: Tensor       # [B] weighted masked cross-entropy at t
    reconstruction: Tensor  # [B] endpoint term at t = 0
    prior: Tensor           # [B] endpoint term at t = 1
    num_masked: Tensor      # [B] masked positions at t

    @property
    def total(self) -> Tensor:
        return self.diffusion + self.reconstruction + self.prior


class DiffusionProcess(ABC):
    """The interface of every diffusion process over ``vocab_size`` clean tokens.

    Methods and arguments (see ``AbsorbingDiffusion`` for the full descriptions, which hold for
    every process): ``corrupt(x0, t, generator, positions=)``, ``nelbo`` and ``nelbo_terms``
    (continuous time, endpoint terms included, ``reconstruction="model" | "uniform"``),
    ``nelbo_discrete`` (T steps) and ``sample``. ``generator`` is one generator or one per
    row; ``positions`` (bool [B, L]) scores only its True tokens. Bad input raises
    ValueError naming the argument; ``validate=False`` skips the value checks (host syncs).

    ``generate_id`` (= V) marks, in a sampling ``prompt``, a position to generate. For the
    absorbing processes it is the mask id; the uniform process has no mask token, so V
    appears only in prompts, never in z_t.
    """

    def __init__(self, vocab_size: int, *, validate: bool = True) -> None:
        check_vocab_size(vocab_size)
        self.vocab_size = vocab_size
        self.validate = validate

    @property
    def generate_id(self) -> int:
        return self.vocab_size

    @abstractmethod
    def corrupt(self, x0: Tensor, t: Tensor, generator: Generators = None, *,
                positions: Tensor | None = None) -> Tensor:
        """Sample z_t ~ q(z_t | x0)."""

    @abstractmethod
    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *, reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """The continuous-time NELBO estimate per sequence with its terms kept apart."""

    @abstractmethod
    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """One-sample unbiased estimate of the T-step NELBO per sequence [B]."""

    # Which samplers (``model.sampling``) apply to the process, and why the others do not.
    samplers: ClassVar[Mapping[str, Sampler]] = {}
    sampler_limits: ClassVar[Mapping[str, str]] = {}
    process_name: ClassVar[str] = ""

    @classmethod
    def sampler(cls, name: str) -> Sampler:
        """The sampler called ``name``; ValueError saying why when it does not apply to this process
        (a class method: a config's process kind is checked before any process exists)."""
        if name in cls.samplers:
            return cls.samplers[name]
        why = cls.sampler_limits.get(name, "unknown sampler")
        raise ValueError(f"the {name} sampler does not apply to the {cls.process_name} process: {why} "
                         f"(its samplers: {', '.join(cls.samplers)})")

    def sample(self, denoiser: DenoiserLike, plan: SamplingPlan, *, num_samples: int, seq_len: int,
               prompt: Tensor | None = None, generator: Generators = None, window: int | None = None,
               device: torch.device | str | None = None) -> tuple[Tensor, SamplingStats]:
        """Sample ``num_samples`` sequences of ``seq_len`` tokens as ``plan`` says; returns them
        (LongTensor [num_samples, seq_len]) and what they cost. See ``model.sampling.draw``:
        ``prompt`` holds tokens to keep and ``generate_id`` where to generate, ``generator`` is
        one generator or one per sample (default: one per sample from ``plan.seed``, so a
        sample does not depend on its batch), ``window`` the network's context for
        ``plan.block_len``. ValueError when ``plan.sampler`` does not apply to the process.
        """
        return draw(self, self.sampler(plan.sampler), denoiser, plan, num_samples=num_samples, seq_len=seq_len,
                    prompt=prompt, generator=generator, window=window, device=device)

    def nelbo(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
              generator: Generators = None, *,
              reconstruction: Reconstruction = "model", positions: Tensor | None = None) -> Tensor:
        """One-sample unbiased estimate of the continuous-time NELBO per sequence, nats [B].

        ``t=None`` draws low-discrepancy times over this batch (``low_discrepancy_times``
        builds them over a global batch). ``reconstruction="model"`` scores the t = 0 term
        with the denoiser; ``"uniform"`` uses a decoder that ignores the network and puts a
        uniform prior on the clean token, through its exact expectation: no network call, a
        slightly looser bound (L * (1 - alpha(0)) * log V for the absorbing processes).
        Distributed training uses ``"uniform"`` so every rank makes the same calls.
        ``positions`` (bool [B, L]) scores only its True tokens: the others are never noised
        and never scored, and the endpoint terms count only the scored tokens.
        """
        return self.nelbo_terms(denoiser, x0, t, generator, reconstruction=reconstruction,
                                positions=positions).total

    # ---------------------------------------------------------------- shared steps
    def _times(self, t: Tensor | None, x0: Tensor, generator: Generators, name: str = "t") -> Tensor:
        """The given per-row times (checked), or low-discrepancy ones over this batch."""
        if t is None:
            t = low_discrepancy_times(x0.shape[0], batch_generator(generator, name), device=x0.device)
        check_row_times(t, x0.shape[0], check_values=self.validate)
        return t

    def _step_times(self, steps: int, u: Tensor | None, x0: Tensor,
                    generator: Generators) -> tuple[Tensor, Tensor]:
        """(t(i), s(i)) = (i/T, (i-1)/T) float64 [B] for the step i = floor(u T) + 1 of each row."""
        check_positive_int("steps", steps)
        u = self._times(u, x0, generator, "u")
        step = torch.floor(u.to(torch.float64) * steps).clamp(max=steps - 1) + 1  # in {1, ..., T}
        return step / steps, (step - 1) / steps

    def _logits_at(self, denoiser: DenoiserLike, z_t: Tensor, t: Tensor, selected: Tensor, count: int) -> Tensor:
        """The denoiser's logits [count, V] at the selected positions."""
        logits = as_denoiser(denoiser).logits_at(z_t, t, selected)
        check_logits(logits, (count, self.vocab_size), self.vocab_size)
        return logits

    def _check_x0(self, x0: Tensor, positions: Tensor | None) -> None:
        """The clean tokens and the scored positions of a bound or of ``corrupt``."""
        self._check_tokens(x0, "x0", allow_mask=False)
        check_positions(positions, x0)

    def _check_tokens(self, x: Tensor, name: str, *, allow_mask: bool) -> None:
        """Clean tokens are in [0, V - 1]; ``allow_mask`` also admits V (mask or prompt gap)."""
        top = self.vocab_size if allow_mask else self.vocab_size - 1
        check_token_ids(x, name, top, check_values=self.validate)



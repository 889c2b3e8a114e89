"""Masked (absorbing-state) diffusion: forward process, NELBO estimators, sampler entry point.

``DiffusionProcess`` is the interface every process shares (this one, GenMD4's learned
state-dependent masking in ``model.state_dependent`` and D3PM's uniform diffusion in
``model.uniform``): the same methods, arguments, randomness rules and input validation, so
one trainer, evaluator and sampler drive any of them.

Notation follows MATH.md: clean tokens 0..V-1, mask id m = V, alpha(t) from a guarded
``Schedule``. The per-sequence continuous-time bound, in nats, is

    NELBO(x) = E_t E_{z_t} [ w(t) * sum_{n: z_t^n = m} -log p_theta(x_n | z_t, t) ]   (diffusion)
             + E_{z_0} [ sum_{n: z_0^n = m} -log p_theta(x_n | z_0, 0) ]             (reconstruction)
             + L * alpha(1) * log V                                                   (prior)

with w(t) = -alpha'(t) / (1 - alpha(t)). The prior term is KL(q(z_1 | x) || p(z_1)) for the
prior p(z_1) = (1 - alpha(1)) * mask + alpha(1) * Uniform(V) per token. Every estimator
here is a one-sample unbiased estimate of its bound, so averages of it are upper bounds on
-log p(x) in expectation.

A denoiser is any callable ``(z_t: LongTensor[B, L], t: FloatTensor[B]) -> logits[B, L, V]``
over the V clean tokens (SUBS: no mask logit, so the mask is never predicted), or a
``model.denoiser.Denoiser``. The bounds ask it for logits at the scored positions only
(``logits_at``: a ``Transformer`` then skips the output projection everywhere else). When
the diffusion has a ``cross_entropy_chunk_rows``, they ask instead for -log p(target) [N]
at those positions (``nll_at``), which a ``Transformer`` computes without materializing the
[N, V] float32 logits (``model.cross_entropy``; the same loss to float rounding); so they
do, all rows at once, whenever the denoiser computes it itself (``Denoiser.fused_nll``).

Scoring only some positions (``positions``, bool [B, L], True = a real token): the others
(padding of a partial evaluation block) are never masked and never scored, so they stay
visible as given, like a prompt, and the bound is one on -log p(real tokens | the others).
The endpoint terms then count only the real tokens. ``positions=None`` scores every token
and draws exactly the same random numbers as before (the mask is only ANDed with it).

Randomness per row: ``generator`` may also be a sequence of generators, one per row
(``model.generators``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from model.checks import (
    check_logits,
    check_nll,
    check_positions,
    check_positive_int,
    check_reconstruction,
    check_row_times,
    check_token_ids,
    check_vocab_size,
)
from model.denoiser import Denoiser, DenoiserLike, as_denoiser
from model.generators import Generators, batch_generator, uniforms
from model.positions import count_scored, sum_by_row
from model.sampling import (
    Sampler,
    SamplingPlan,
    SamplingStats,
    ancestral_sample,
    confidence_sample,
    draw,
    first_hitting_sample,
    remask_sample,
)
from model.schedules import Schedule

Reconstruction = Literal["model", "uniform"]

__all__ = ["DiffusionProcess", "MaskedDiffusion", "NelboTerms", "Reconstruction", "low_discrepancy_times"]


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

    Methods and arguments (see ``MaskedDiffusion`` for the full descriptions, which hold for
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
        ``positions`` (bool [B, L]) scores only its True tokens; see the module docstring.
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

    def _check_tokens(self, x: Tensor, name: str, *, allow_mask: bool) -> None:
        """Clean tokens are in [0, V - 1]; ``allow_mask`` also admits V (mask or prompt gap)."""
        top = self.vocab_size if allow_mask else self.vocab_size - 1
        check_token_ids(x, name, top, check_values=self.validate)


class MaskedDiffusion(DiffusionProcess):
    """The absorbing-state diffusion over ``vocab_size`` tokens with mask id ``vocab_size``.

    ``validate`` checks token ranges and times on every call; each check synchronizes the
    host with the device, so a GPU trainer fed by validated shards may turn it off.
    ``cross_entropy_chunk_rows`` > 0 asks the denoiser for the masked cross-entropy itself,
    that many rows at a time (``Denoiser.nll_at``, see the module docstring); 0 asks it for
    logits, unless it computes the cross-entropy itself (``Denoiser.fused_nll``: all rows at once).
    """

    schedule_type: type = Schedule  # what ``schedule`` must be (a subclass may widen it)
    process_name = "absorbing"
    samplers = {"ancestral": ancestral_sample, "first-hitting": first_hitting_sample,
                "confidence": confidence_sample, "remdm": remask_sample}

    def __init__(self, schedule: Schedule, vocab_size: int, *, validate: bool = True,
                 cross_entropy_chunk_rows: int = 0) -> None:
        if not isinstance(schedule, self.schedule_type):
            raise ValueError(f"schedule must be a {self.schedule_type.__module__}."
                             f"{self.schedule_type.__name__}, got {schedule!r}")
        super().__init__(vocab_size, validate=validate)
        if (isinstance(cross_entropy_chunk_rows, bool) or not isinstance(cross_entropy_chunk_rows, int)
                or cross_entropy_chunk_rows < 0):
            raise ValueError(f"cross_entropy_chunk_rows must be an int >= 0, got {cross_entropy_chunk_rows!r}")
        self.schedule = schedule
        self.cross_entropy_chunk_rows = cross_entropy_chunk_rows

    @property
    def mask_id(self) -> int:
        return self.vocab_size

    # ---------------------------------------------------------------- forward process
    def corrupt(self, x0: Tensor, t: Tensor, generator: Generators = None, *,
                positions: Tensor | None = None) -> Tensor:
        """Sample z_t ~ q(z_t | x0): each token independently masked with prob 1 - alpha(t).

        Positions where ``positions`` is False are never masked.
        """
        self._check_tokens(x0, "x0", allow_mask=False)
        check_row_times(t, x0.shape[0], check_values=self.validate)
        check_positions(positions, x0)
        return self._corrupt(x0, t, generator, positions)[0]

    def _corrupt(self, x0: Tensor, t: Tensor, generator: Generators,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        masking_rate = self.schedule.masking_rate(t.to(torch.float64)).to(x0.device)
        # float64 uniforms: masking rates near t = 0 are ~1e-4 and must not be quantized.
        u = uniforms(x0.shape, generator, x0.device)
        masked = u < masking_rate[:, None]
        if positions is not None:  # the same draws either way: padding just never masks
            masked &= positions
        return torch.where(masked, self.mask_id, x0), masked

    # ---------------------------------------------------------------- bounds
    # ``nelbo`` (DiffusionProcess) is ``nelbo_terms(...).total``. The "model" reconstruction
    # calls the denoiser only on the sequences that have a masked token at t = 0 (about
    # L * endpoint_eps of them); "uniform" costs exactly L * (1 - alpha(0)) * log V.

    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *,
                    reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """``nelbo`` with its terms kept apart (evaluation plots the per-t contribution)."""
        self._check_tokens(x0, "x0", allow_mask=False)
        check_positions(positions, x0)
        check_reconstruction(reconstruction)
        t = self._times(t, x0, generator)
        # Schedule math runs where t lives: CPU times keep a GPU step free of host syncs.
        weight = self.schedule.weight(t.to(torch.float64)).to(x0.device)
        cross_entropy, num_masked = self._masked_cross_entropy(denoiser, x0, t, generator, positions)
        return NelboTerms(
            t=t,
            diffusion=weight * cross_entropy,
            reconstruction=self._reconstruction(denoiser, x0, generator, reconstruction, positions),
            prior=self._prior(x0, positions),
            num_masked=num_masked,
        )

    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """One-sample unbiased estimate of the T-step discrete-time NELBO per sequence [B].

        The grid is t(i) = i/T, s(i) = (i-1)/T. Step i is drawn uniformly (stratified over
        the batch) and its KL, (alpha_s - alpha_t) / (1 - alpha_t) times the masked
        cross-entropy, is scaled by T. Endpoint terms as in ``nelbo``. ``u`` (float [B] in
        [0, 1]) gives the uniforms that pick the steps (row b scores step floor(u_b T) + 1)
        instead of drawing them here, as ``t`` does for ``nelbo``.
        """
        self._check_tokens(x0, "x0", allow_mask=False)
        check_positions(positions, x0)
        t, s = self._step_times(steps, u, x0, generator)
        alpha_t, alpha_s = self.schedule.alpha(t), self.schedule.alpha(s)
        step_weight = (steps * (alpha_s - alpha_t) / self.schedule.masking_rate(t)).to(x0.device)
        cross_entropy, _ = self._masked_cross_entropy(denoiser, x0, t, generator, positions)
        return (step_weight * cross_entropy
                + self._reconstruction(denoiser, x0, generator, "model", positions)
                + self._prior(x0, positions))

    def _masked_cross_entropy(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor,
                              generator: Generators, positions: Tensor | None,
                              ) -> tuple[Tensor, Tensor]:
        """Sample z_t; return sum over masked n of -log p(x_n | z_t, t) per sequence (float64)
        and the number of masked positions."""
        z_t, masked = self._corrupt(x0, t, generator, positions)
        t = t.to(x0.device)
        return self.masked_token_nll(denoiser, z_t, t, x0, masked), masked.sum(-1)

    def masked_token_nll(self, denoiser: DenoiserLike, z_t: Tensor, t: Tensor, x0: Tensor,
                         masked: Tensor) -> Tensor:
        """Sum over masked positions of -log softmax(f(z_t, t))[x0], per sequence, float64.

        The log-softmax runs in float32 even when the network returns bf16 logits.
        """
        return self.masked_nll_by_group(as_denoiser(denoiser), z_t, t, x0, masked, x0.shape[1])

    def masked_nll_by_group(self, denoiser: Denoiser, z_t: Tensor, t: Tensor | None, x0: Tensor, masked: Tensor,
                            group_len: int) -> Tensor:
        """Sum of -log softmax(f(z_t, t))[x0] over the masked positions of each run of
        ``group_len`` consecutive positions (a sequence: L; a block: L'), float64 [B * L / group_len]."""
        # One read of the masked positions (a host sync on a GPU); groups and targets follow on the device.
        flat = masked.flatten().nonzero().squeeze(1)
        groups, targets = torch.div(flat, group_len, rounding_mode="floor"), x0.flatten().index_select(0, flat)
        if self.cross_entropy_chunk_rows or denoiser.fused_nll:
            nll = denoiser.nll_at(z_t, t, masked, targets, self.cross_entropy_chunk_rows or None)
            check_nll(nll, flat.numel())
        else:
            nll = F.cross_entropy(self._logits_at(denoiser, z_t, t, masked, flat.numel()).float(), targets,
                                  reduction="none")
        return sum_by_row(nll, groups, x0.numel() // group_len)

    def _reconstruction(self, denoiser: DenoiserLike, x0: Tensor, generator: Generators,
                        kind: Reconstruction, positions: Tensor | None = None) -> Tensor:
        batch, length = x0.shape
        if kind == "uniform":
            rate = self._endpoint_masking_rate(0.0)
            if positions is not None:
                return rate * count_scored(positions) * math.log(self.vocab_size)
            return x0.new_full((batch,), rate * length * math.log(self.vocab_size), dtype=torch.float64)
        check_reconstruction(kind)
        zero_time = torch.zeros(batch, dtype=torch.float64, device=x0.device)
        z_0, masked = self._corrupt(x0, zero_time, generator, positions)
        needed = masked.any(-1)
        out = torch.zeros(batch, dtype=torch.float64, device=x0.device)
        if bool(needed.any()):
            out[needed] = self.masked_token_nll(
                denoiser, z_0[needed], zero_time[needed], x0[needed], masked[needed])
        return out

    def _prior(self, x0: Tensor, positions: Tensor | None = None) -> Tensor:
        batch, length = x0.shape
        alpha_one = 1.0 - self._endpoint_masking_rate(1.0)
        if positions is not None:  # KL(q(z_1 | x) || p(z_1)) of the real tokens only
            return alpha_one * count_scored(positions) * math.log(self.vocab_size)
        return x0.new_full((batch,), alpha_one * length * math.log(self.vocab_size), dtype=torch.float64)

    def _endpoint_masking_rate(self, t: float) -> float:
        return float(self.schedule.masking_rate(torch.tensor([t], dtype=torch.float64)))

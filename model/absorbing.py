"""Masked (absorbing-state) diffusion: forward process, NELBO estimators, sampler entry point.

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

import torch
import torch.nn.functional as F
from torch import Tensor

from model.checks import (
    check_nll,
    check_positions,
    check_reconstruction,
    check_row_times,
)
from model.denoiser import Denoiser, DenoiserLike, as_denoiser
from model.generators import Generators, uniforms
from model.positions import count_scored, sum_by_row
from model.process import DiffusionProcess, NelboTerms, Reconstruction
from model.sampling import (
    ancestral_sample,
    confidence_sample,
    first_hitting_sample,
    remask_sample,
)
from model.schedules import Schedule

__all__ = ["AbsorbingDiffusion"]


class AbsorbingDiffusion(DiffusionProcess):
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

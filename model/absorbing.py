"""The absorbing diffusion process (MDLM, MD4): each token is masked independently, mask id V.

``nelbo_terms`` is the continuous-time bound with both endpoint terms, per sequence in nats
(docs/math.md#the-bound), and ``nelbo_discrete`` the T-step one
(docs/math.md#the-discrete-time-bound); each is a one-sample unbiased estimate. The network
is asked only for the masked positions (``masked_nll``, then ``Denoiser.nll_at`` or
``logits_at``). ``positions`` scores only its True tokens, the others never masked; leaving
it out draws the same random numbers. ``generator`` is one generator or one per row
(``model.generators``). ``BlockDiffusion`` and ``LearnedDiffusion`` extend this class.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from model.checks import check_nll, check_reconstruction, check_row_times
from model.denoiser import Denoiser, DenoiserLike, as_denoiser
from model.generators import Generators, uniforms
from model.positions import count_scored, sum_by_row
from model.process import DiffusionProcess, NelboTerms, Reconstruction
from model.sampling import (
    ancestral_sample,
    confidence_sample,
    first_hitting_sample,
    remask_sample,
    threshold_sample,
)
from model.schedules import Schedule

__all__ = ["AbsorbingDiffusion"]


class AbsorbingDiffusion(DiffusionProcess):
    """The absorbing diffusion over ``vocab_size`` tokens with mask id ``vocab_size``.

    ``validate`` checks token ranges and times on every call; each check synchronizes the
    host with the device, so a GPU trainer fed by validated shards may turn it off.
    ``cross_entropy_chunk_rows`` > 0 asks the denoiser for the masked cross-entropy itself,
    that many rows at a time (``Denoiser.nll_at``); 0 asks it for logits, unless it
    computes the cross-entropy itself (``Denoiser.fused_nll``: all rows at once).
    """

    schedule_type: type = Schedule  # what ``schedule`` must be (a subclass may widen it)
    process_name = "absorbing"
    samplers = {"ancestral": ancestral_sample, "first-hitting": first_hitting_sample,
                "confidence": confidence_sample, "remdm": remask_sample, "threshold": threshold_sample}

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
        self._check_x0(x0, positions)
        check_row_times(t, x0.shape[0], check_values=self.validate)
        return self._corrupt(x0, t, generator, positions)[0]

    def _corrupt(self, x0: Tensor, t: Tensor, generator: Generators,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(z_t, masked): z_t [B, L] and where it holds the mask (bool [B, L])."""
        masking_rate = self.schedule.masking_rate(t.to(torch.float64)).to(x0.device)
        # float64 uniforms: masking rates near t = 0 are ~1e-4 and must not be quantized.
        u = uniforms(x0.shape, generator, x0.device)
        masked = u < masking_rate[:, None]
        if positions is not None:  # the same draws either way: padding just never masks
            masked &= positions
        return torch.where(masked, self.mask_id, x0), masked

    # ---------------------------------------------------------------- bounds
    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *,
                    reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """``nelbo`` with its terms kept apart (docs/math.md#the-bound): the diffusion term
        w(t) sum_{n masked} -log p(x_n | z_t, t), the reconstruction at t = 0, the prior at t = 1."""
        self._check_x0(x0, positions)
        check_reconstruction(reconstruction)
        t = self._times(t, x0, generator)
        # Schedule math runs where t lives: CPU times keep a GPU step free of host syncs.
        weight = self.schedule.weight(t.to(torch.float64)).to(x0.device)            # w(t) [B]
        z_t, masked = self._corrupt(x0, t, generator, positions)
        return NelboTerms(
            t=t,
            diffusion=weight * self.masked_nll(denoiser, z_t, t.to(x0.device), x0, masked).sum(-1),
            reconstruction=self._reconstruction(denoiser, x0, generator, reconstruction, positions),
            prior=self._prior(x0, positions),
            num_masked=masked.sum(-1),
        )

    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """One-sample unbiased estimate of the T-step bound per sequence [B]
        (docs/math.md#the-discrete-time-bound).

        The grid is t(i) = i/T, s(i) = (i-1)/T. Step i is drawn uniformly (stratified over
        the batch) and its KL, (alpha_s - alpha_t) / (1 - alpha_t) times the masked
        cross-entropy, is scaled by T. Endpoint terms as in ``nelbo``. ``u`` (float [B] in
        [0, 1]) gives the uniforms that pick the steps (row b scores step floor(u_b T) + 1)
        instead of drawing them here, as ``t`` does for ``nelbo``.
        """
        self._check_x0(x0, positions)
        t, s = self._step_times(steps, u, x0, generator)
        alpha_t, alpha_s = self.schedule.alpha(t), self.schedule.alpha(s)
        step_weight = (steps * (alpha_s - alpha_t) / self.schedule.masking_rate(t)).to(x0.device)
        z_t, masked = self._corrupt(x0, t, generator, positions)
        return (step_weight * self.masked_nll(denoiser, z_t, t.to(x0.device), x0, masked).sum(-1)
                + self._reconstruction(denoiser, x0, generator, "model", positions)
                + self._prior(x0, positions))

    def num_blocks(self, length: int) -> int:
        """Blocks of a sequence of ``length`` tokens that the bound scores apart: one, the
        whole sequence (``BlockDiffusion`` has L / L')."""
        return 1

    def masked_nll(self, denoiser: DenoiserLike, z_t: Tensor, t: Tensor | None, x0: Tensor,
                   masked: Tensor) -> Tensor:
        """-log softmax(f(z_t, t))[x0_n] summed over the masked positions n of each block,
        float64 [B, blocks] (``num_blocks``: one here, L / L' for block diffusion).

        The log-softmax runs in float32 even when the network returns bf16 logits.
        """
        denoiser = self._block_denoiser(denoiser, x0)
        block_len = x0.shape[1] // self.num_blocks(x0.shape[1])
        # One read of the masked positions (a host sync on a GPU); blocks and targets follow on the device.
        flat = masked.flatten().nonzero().squeeze(1)
        blocks, targets = torch.div(flat, block_len, rounding_mode="floor"), x0.flatten().index_select(0, flat)
        if self.cross_entropy_chunk_rows or denoiser.fused_nll:
            nll = denoiser.nll_at(z_t, t, masked, targets, self.cross_entropy_chunk_rows or None)
            check_nll(nll, flat.numel())
        else:
            nll = F.cross_entropy(self._logits_at(denoiser, z_t, t, masked, flat.numel()).float(), targets,
                                  reduction="none")
        return sum_by_row(nll, blocks, x0.numel() // block_len).view(x0.shape[0], -1)  # [B * blocks] -> [B, blocks]

    def _block_denoiser(self, denoiser: DenoiserLike, x0: Tensor) -> Denoiser:
        """What predicts the masked tokens of x0's blocks: the denoiser itself (one block)."""
        return as_denoiser(denoiser)

    def _reconstruction(self, denoiser: DenoiserLike, x0: Tensor, generator: Generators,
                        kind: Reconstruction, positions: Tensor | None = None) -> Tensor:
        """The t = 0 term, E_{z_0} sum_{n masked} -log p(x_n | z_0, 0), per sequence: scored by the
        denoiser ("model"), or by the uniform decoder in closed form, L (1 - alpha(0)) log V ("uniform")."""
        if kind == "uniform":
            rate = self._endpoint_masking_rate(0.0)
            if positions is not None:
                return rate * count_scored(positions) * math.log(self.vocab_size)
            return x0.new_full((x0.shape[0],), rate * x0.shape[1] * math.log(self.vocab_size), dtype=torch.float64)
        zero_time = torch.zeros(x0.shape[0], dtype=torch.float64, device=x0.device)
        z_0, masked = self._corrupt(x0, zero_time, generator, positions)
        needed = masked.any(-1)  # about L * endpoint_eps of the sequences: only they call the denoiser
        out = torch.zeros(x0.shape[0], dtype=torch.float64, device=x0.device)
        if bool(needed.any()):
            out[needed] = self.masked_nll(denoiser, z_0[needed], zero_time[needed], x0[needed],
                                          masked[needed]).sum(-1)
        return out

    def _prior(self, x0: Tensor, positions: Tensor | None = None) -> Tensor:
        """The t = 1 term, KL(q(z_1 | x) || p(z_1)) = L alpha(1) log V, the scored tokens only."""
        alpha_one = 1.0 - self._endpoint_masking_rate(1.0)
        if positions is not None:
            return alpha_one * count_scored(positions) * math.log(self.vocab_size)
        return x0.new_full((x0.shape[0],), alpha_one * x0.shape[1] * math.log(self.vocab_size), dtype=torch.float64)

    def _endpoint_masking_rate(self, t: float) -> float:
        return float(self.schedule.masking_rate(torch.tensor([t], dtype=torch.float64)))

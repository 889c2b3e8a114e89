"""Uniform diffusion (D3PM): a token is replaced by a uniformly random token; there is no mask.

q(z_t | x) = alpha_t onehot(x) + (1 - alpha_t) / V per position, alpha(t) a guarded
``Schedule``; the network sees z_t in [0, V)^L and predicts the clean token, and the reverse
step mixes the posteriors q(z_s | z_t, y) with that prediction. ``nelbo_terms`` is the
continuous-time bound (the generalized KL between the true and the model's reverse jump
rates, at every position) with both endpoint terms, ``nelbo_discrete`` D3PM's T-step bound.
The math, with the closed forms computed here: docs/math.md#uniform-diffusion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.checks import check_reconstruction, check_row_times
from model.denoiser import DenoiserLike
from model.generators import Generators, uniforms
from model.positions import count_scored, scored_positions, sum_by_row
from model.process import DiffusionProcess, NelboTerms, Reconstruction
from model.sampling import reverse_sample
from model.schedules import Schedule

__all__ = ["UniformDiffusion"]


class UniformDiffusion(DiffusionProcess):
    """D3PM's uniform diffusion over ``vocab_size`` tokens with the guarded ``schedule``.

    The same interface as ``AbsorbingDiffusion``. z_t holds ids in [0, V): there is no mask
    token, so ``num_masked`` in ``NelboTerms`` counts the positions whose token the noise
    changed, and a sampling ``prompt`` marks the positions to generate with ``generate_id``
    (= V, one past the vocabulary, as the mask id in the absorbing processes); they start
    from uniform random tokens, the others are kept. The denoiser does not see which tokens
    are kept: it treats them as noisy, as it treats padding outside ``positions``.
    """

    process_name = "uniform"
    samplers = {"ancestral": reverse_sample}
    sampler_limits = {
        "first-hitting": "there is no absorbing mask: every token may change many times, so there is no "
                         "first unmasking event to draw",
        "confidence": "there is no mask to reveal: every position holds a token from the first step",
        "remdm": "there is no mask to remask into",
        "threshold": "there is no mask to reveal: every position holds a token from the first step"}

    def __init__(self, schedule: Schedule, vocab_size: int, *, validate: bool = True) -> None:
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a model.schedules.Schedule, got {schedule!r}")
        super().__init__(vocab_size, validate=validate)
        self.schedule = schedule

    # ---------------------------------------------------------------- forward process
    def corrupt(self, x0: Tensor, t: Tensor, generator: Generators = None, *,
                positions: Tensor | None = None) -> Tensor:
        """Sample z_t ~ q(z_t | x0): each token kept with prob alpha(t), otherwise replaced by a
        uniform token (itself included). Positions where ``positions`` is False are kept."""
        self._check_x0(x0, positions)
        check_row_times(t, x0.shape[0], check_values=self.validate)
        return self._corrupt(x0, t, generator, positions)

    def _corrupt(self, x0: Tensor, t: Tensor, generator: Generators,
                 positions: Tensor | None = None) -> Tensor:
        alpha = self.schedule.alpha(t.to(torch.float64)).to(x0.device)[:, None]
        # One float64 uniform per position: below alpha keeps the token, the rest of [0, 1)
        # rescaled to [0, 1) picks the uniform replacement.
        u = uniforms(x0.shape, generator, x0.device)
        noise = torch.floor((u - alpha) / (1.0 - alpha) * self.vocab_size).long().clamp_(0, self.vocab_size - 1)
        keep = u < alpha
        if positions is not None:
            keep |= ~positions
        return torch.where(keep, x0, noise)

    # ---------------------------------------------------------------- schedule quantities
    def _signal_to_noise(self, t: Tensor) -> Tensor:
        """rho_t = V alpha_t / (1 - alpha_t), float64."""
        return self.vocab_size * self.schedule.alpha(t) / self.schedule.masking_rate(t)

    def _jump_rate(self, t: Tensor) -> Tensor:
        """beta_t / V = -alpha'_t / (V alpha_t): the forward rate of a jump to each given token."""
        return -self.schedule.alpha_derivative(t) / (self.vocab_size * self.schedule.alpha(t))

    # ---------------------------------------------------------------- bounds
    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *,
                    reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """``AbsorbingDiffusion.nelbo_terms`` for the uniform process (docs/math.md#uniform-diffusion):
        the diffusion term is the rate divergence at every scored position; ``num_masked`` counts
        the positions the noise changed."""
        self._check_x0(x0, positions)
        check_reconstruction(reconstruction)
        t = self._times(t, x0, generator)
        z_t = self._corrupt(x0, t, generator, positions)
        return NelboTerms(
            t=t,
            diffusion=self._rate_divergence(denoiser, x0, z_t, t, scored_positions(x0, positions)),
            reconstruction=self._reconstruction(denoiser, x0, generator, reconstruction, positions),
            prior=self._prior(x0, positions),
            num_masked=(z_t != x0).sum(-1),
        )

    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """One-sample unbiased estimate of D3PM's T-step NELBO per sequence [B]: step i drawn
        as in ``AbsorbingDiffusion.nelbo_discrete``, T times its KL summed over the scored
        positions, plus the endpoint terms (reconstruction by the model)."""
        self._check_x0(x0, positions)
        t, s = self._step_times(steps, u, x0, generator)
        z_t = self._corrupt(x0, t, generator, positions)
        return (steps * self._step_kl(denoiser, x0, z_t, t, s, scored_positions(x0, positions))
                + self._reconstruction(denoiser, x0, generator, "model", positions)
                + self._prior(x0, positions))

    def _rate_divergence(self, denoiser: DenoiserLike, x0: Tensor, z_t: Tensor, t: Tensor, scored: Tensor) -> Tensor:
        """The diffusion term at t: the generalized KL between the true and the model's reverse
        jump rates, (-alpha'_t / (V alpha_t)) sum over the scored positions of sum_{j != z}
        (g_j - r_j - r_j log(g_j / r_j)) (docs/math.md#uniform-diffusion), float64 [B]."""
        rows, x, z, log_mu = self._prediction(denoiser, x0, z_t, t, scored)
        t = t.to(torch.float64)
        rho = self._signal_to_noise(t).to(device=log_mu.device, dtype=log_mu.dtype)[rows, None]
        divergence = sum_by_row(self._jump_divergence(x, z, log_mu.exp(), rho), rows, x0.shape[0])
        return self._jump_rate(t).to(x0.device) * divergence

    def _step_kl(self, denoiser: DenoiserLike, x0: Tensor, z_t: Tensor, t: Tensor, s: Tensor,
                 scored: Tensor) -> Tensor:
        """sum over the scored positions of KL(q(z_s | z_t, x) || p(z_s | z_t)), float64 [B]."""
        rows, x, z, log_mu = self._prediction(denoiser, x0, z_t, t, scored)
        ratios = [r.to(device=log_mu.device, dtype=log_mu.dtype)[rows, None] for r in self._step_ratios(t, s)]
        model = self._posterior_weights(z, log_mu.exp(), *ratios)
        truth = self._posterior_weights(z, F.one_hot(x, self.vocab_size).to(log_mu.dtype), *ratios)
        kl = (truth / truth.sum(-1, keepdim=True) * (truth.log() - model.log())).sum(-1)
        return sum_by_row(kl, rows, x0.shape[0])

    def _prediction(self, denoiser: DenoiserLike, x0: Tensor, z_t: Tensor, t: Tensor, scored: Tensor,
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(rows, x, z, log mu) at the scored positions; log mu in float32 for a network
        (bf16 upcast), float64 for float64 logits."""
        rows = scored.nonzero(as_tuple=True)[0]
        logits = self._logits_at(denoiser, z_t, t.to(z_t.device), scored, rows.numel())
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return rows, x0[scored], z_t[scored], torch.log_softmax(logits.to(dtype), dim=-1)

    def _jump_divergence(self, x: Tensor, z: Tensor, mu: Tensor, rho: Tensor) -> Tensor:
        """sum_{j != z} (g_j - r_j - r_j log(g_j / r_j)) per position [N], as r_j phi((g_j - r_j) / r_j),
        phi(u) = u - log(1 + u), from the difference g_j - r_j in closed form (no cancellation)."""
        x_hot = F.one_hot(x, self.vocab_size).to(mu.dtype)
        x_is_z = (x == z).to(mu.dtype)[:, None]
        mu_z = mu.gather(1, z[:, None])
        gap = rho * (mu - x_hot) - rho / (1.0 + rho) * (mu_z - x_is_z)     # g_j - r_j
        ratio = (1.0 + rho * x_hot) / (1.0 + rho * x_is_z)                 # r_j
        relative = gap / ratio
        divergence = ratio * (relative - torch.log1p(relative))
        return divergence.scatter(1, z[:, None], 0.0).sum(-1)               # j = z is no jump

    def _step_ratios(self, t: Tensor, s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rho_t, rho_s, rho_{t|s}) float64; rho_{t|s} = V alpha_t / (alpha_s - alpha_t)."""
        t, s = t.to(torch.float64), s.to(torch.float64)
        gap = self.schedule.masking_rate(t) - self.schedule.masking_rate(s)   # alpha_s - alpha_t
        return (self._signal_to_noise(t), self._signal_to_noise(s),
                self.vocab_size * self.schedule.alpha(t) / gap)

    def _posterior_weights(self, z: Tensor, mu: Tensor, rho_t: Tensor, rho_s: Tensor,
                           rho_ts: Tensor) -> Tensor:
        """(1 + rho_{t|s} [j = z]) B_j(mu) [N, V]: p(z_s = j | z_t = z) up to the factor kappa."""
        z_hot = F.one_hot(z, self.vocab_size).to(mu.dtype)
        mu_z = mu.gather(1, z[:, None])
        b = 1.0 - mu_z * rho_t / (1.0 + rho_t) + rho_s * mu / (1.0 + rho_t * z_hot)
        return (1.0 + rho_ts * z_hot) * b

    def _reconstruction(self, denoiser: DenoiserLike, x0: Tensor, generator: Generators,
                        kind: Reconstruction, positions: Tensor | None) -> Tensor:
        """The t = 0 term, E_{z_0} sum_n -log p(x_n | z_0, 0): scored by the denoiser ("model"), or
        by the decoder p(x_n | z_0) = q_0(z_0^n | x_n) through its exact expectation, L H(q_0(. | x))
        ("uniform")."""
        if kind == "uniform":
            alpha0 = self._endpoint_alpha(0.0)
            noise = (1.0 - alpha0) / self.vocab_size
            entropy = -(torch.xlogy(alpha0 + noise, alpha0 + noise)
                        + (self.vocab_size - 1) * torch.xlogy(noise, noise))
            return entropy * count_scored(scored_positions(x0, positions))
        zero_time = torch.zeros(x0.shape[0], dtype=torch.float64, device=x0.device)
        z_0 = self._corrupt(x0, zero_time, generator, positions)
        scored = scored_positions(x0, positions)
        rows, x, _, log_mu = self._prediction(denoiser, x0, z_0, zero_time, scored)
        return sum_by_row(-log_mu.gather(1, x[:, None]).squeeze(1), rows, x0.shape[0])

    def _prior(self, x0: Tensor, positions: Tensor | None) -> Tensor:
        """L KL(q_1(. | x) || Uniform(V)), the real tokens only."""
        alpha1 = self._endpoint_alpha(1.0)
        noise = (1.0 - alpha1) / self.vocab_size
        kl = (torch.xlogy(alpha1 + noise, self.vocab_size * (alpha1 + noise))
              + (self.vocab_size - 1) * torch.xlogy(noise, self.vocab_size * noise))
        return kl * count_scored(scored_positions(x0, positions))

    def _endpoint_alpha(self, t: float) -> Tensor:
        return self.schedule.alpha(torch.tensor(t, dtype=torch.float64))

    # ---------------------------------------------------------------- sampling
    # Ancestral sampling from Uniform(V)^L at t = 1 with p(z_s | z_t) (docs/math.md#uniform-diffusion) runs
    # through ``reverse_sample``: every step needs the network (any token may still change).
    def prior_tokens(self, z: Tensor, free: Tensor, u: Tensor) -> Tensor:
        """z with its ``free`` positions drawn from Uniform(V) (the prior at t = 1) by the
        uniforms ``u`` [B, L]."""
        return torch.where(free, torch.floor(u * self.vocab_size).long(), z)

    def changeable(self, z: Tensor) -> Tensor:
        """Every position: any token may still change."""
        return torch.ones_like(z, dtype=torch.bool)

    def reverse_kernel(self, z: Tensor, mu: Tensor, t: float, s: float | None) -> Tensor:
        """p(z_s | z_t = z) up to a constant; ``s=None`` (the last step) draws from mu."""
        if s is None:
            return mu
        ratios = self._step_ratios(torch.tensor([t], dtype=torch.float64), torch.tensor([s], dtype=torch.float64))
        return self._posterior_weights(z, mu, *(r.to(mu.device)[:, None] for r in ratios))


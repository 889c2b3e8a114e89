"""The tests' oracle: a distribution over all V^L sequences given as a table, with its exact conditionals.

``EnumerableDistribution`` is the optimal denoiser of the absorbing process and computes,
without Monte Carlo, the exact expectations of the bounds and the exact laws of the samplers
that the estimators are checked against (docs/math.md#the-exact-conditionals-identity). For
any process it writes one position's forward process as explicit matrices from the schedule
alone (``_Channel``), never from the processes' closed forms, and works by brute force over
every noisy sequence: meant for V^L up to a few thousand.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import Tensor

from model.absorbing import AbsorbingDiffusion
from model.denoiser import Denoiser, DenoiserFunction, DenoiserLike, FunctionDenoiser, as_denoiser
from model.process import DiffusionProcess
from model.sampling import time_grid
from model.schedules import Schedule
from model.uniform import UniformDiffusion

__all__ = ["EnumerableDistribution"]

# Quadrature of the continuous bound: 10 Gauss-Legendre nodes on each of [2^-(k+1), 2^-k],
# k < 40, and on [0, 2^-40]. The integrands are smooth inside each interval; at t = 0 they
# behave like t^(w-1) (GenMD4, w the exponent) or log t, which the dyadic intervals resolve:
# the part below 2^-40 is 2^(-40 w) of the integral (1e-6 for w = 1/2), itself mostly captured.
QUADRATURE_LEVELS, QUADRATURE_POINTS = 40, 10
# Memory bounds: rows per call when the oracle evaluates a denoiser or its own posterior, and
# quadrature nodes (or steps) per batch of [nodes, states, sequences, L, K] tensors.
CHUNK_ROWS = 32_768
NODES_PER_CHUNK = 32


def _dyadic_gauss_legendre(levels: int = QUADRATURE_LEVELS, points: int = QUADRATURE_POINTS,
                           ) -> tuple[Tensor, Tensor]:
    """Nodes and weights (float64) integrating over [0, 1]: Gauss-Legendre on [0, 2^-levels]
    and on each [2^-(k+1), 2^-k], k < levels."""
    base_nodes, base_weights = np.polynomial.legendre.leggauss(points)
    edges = [0.0] + [2.0**-k for k in range(levels, -1, -1)]
    nodes = [(b - a) / 2 * base_nodes + (a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    weights = [(b - a) / 2 * base_weights for a, b in zip(edges[:-1], edges[1:])]
    return torch.from_numpy(np.concatenate(nodes)), torch.from_numpy(np.concatenate(weights))


class _Channel:
    """One position's forward process as explicit matrices over its K states, from the schedule.

    Absorbing (and per token value ``LearnedDiffusion``): the V tokens and the mask (K = V + 1),
    q(z_t | v) = alpha_{t,v} e_v + (1 - alpha_{t,v}) e_m, a token v jumps to the mask at rate
    -alpha'_{t,v} / alpha_{t,v}. Uniform: K = V, q(z_t | v) = alpha_t e_v + (1 - alpha_t) / V, a
    jump to each token at rate -alpha'_t / (V alpha_t). Every method maps times [N] (float64)
    to per-time matrices.
    """

    def __init__(self, process: DiffusionProcess) -> None:
        if not isinstance(process, (AbsorbingDiffusion, UniformDiffusion)):
            raise ValueError(f"no forward matrices for {type(process).__name__}")
        self.uniform = isinstance(process, UniformDiffusion)
        self.vocab_size = process.vocab_size
        self.states = self.vocab_size if self.uniform else self.vocab_size + 1
        self.schedule = process.schedule

    def _alphas(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """alpha, 1 - alpha (from the schedule's masking rate, exact near t = 0) and alpha',
        each [N, V] (a scalar schedule is the same for every token value)."""
        with torch.no_grad():
            t = t.to(torch.float64)
            values = [self.schedule.alpha(t), self.schedule.masking_rate(t), self.schedule.alpha_derivative(t)]
        return tuple(v.cpu().reshape(t.shape[0], -1).expand(-1, self.vocab_size) for v in values)

    def _tokens_to(self, keep: Tensor, leave: Tensor) -> Tensor:
        """[N, V, K]: each token v stays with prob keep[:, v] and otherwise goes to the mask
        (absorbing) or to a uniform token (uniform)."""
        n, v = keep.shape
        matrix = torch.zeros(n, v, self.states, dtype=torch.float64)
        if self.uniform:
            matrix += leave[:, :, None] / v
        else:
            matrix[:, :, v] = leave
        return matrix + torch.nn.functional.pad(torch.diag_embed(keep), (0, self.states - v))

    def marginal(self, t: Tensor) -> Tensor:
        """q(z_t = k | x = v), [N, V, K]."""
        alpha, masking, _ = self._alphas(t)
        return self._tokens_to(alpha, masking)

    def transition(self, s: Tensor, t: Tensor) -> Tensor:
        """q(z_t = k | z_s = j), [N, K, K]."""
        alpha_s, _, _ = self._alphas(s)
        alpha_t, _, _ = self._alphas(t)
        kept = alpha_t / alpha_s
        left = (alpha_s - alpha_t) / alpha_s
        tokens = self._tokens_to(kept, left)
        if self.uniform:
            return tokens
        mask_row = torch.zeros(t.shape[0], 1, self.states, dtype=torch.float64)
        mask_row[:, 0, -1] = 1.0
        return torch.cat([tokens, mask_row], dim=1)

    def rates(self, t: Tensor) -> Tensor:
        """Forward jump rates R(j -> k) for k != j (diagonal 0), [N, K, K]."""
        alpha, _, derivative = self._alphas(t)
        hazard = -derivative / alpha                                   # total jump rate of token v
        rates = torch.zeros(t.shape[0], self.states, self.states, dtype=torch.float64)
        if self.uniform:
            rates += hazard[:, :, None] / self.vocab_size
        else:
            rates[:, :self.vocab_size, -1] = hazard
        return rates * (1.0 - torch.eye(self.states, dtype=torch.float64))

    def prior(self) -> Tensor:
        """p(z_1) over the K states."""
        if self.uniform:
            return torch.full((self.states,), 1.0 / self.states, dtype=torch.float64)
        alpha_one = float(self._alphas(torch.ones(1, dtype=torch.float64))[0].mean())
        prior = torch.full((self.states,), alpha_one / self.vocab_size, dtype=torch.float64)
        prior[-1] = 1.0 - alpha_one
        return prior

    def posterior(self, s: Tensor, t: Tensor) -> Tensor:
        """q(z_s = j | z_t = k, x = y) = q(z_s = j | y) q(z_t = k | z_s = j) / q(z_t = k | y),
        [N, V(y), K(k), K(j)]; 0 where q(z_t = k | y) = 0."""
        marginal_t = self.marginal(t)
        joint = self.marginal(s)[:, :, None, :] * self.transition(s, t).transpose(1, 2)[:, None]
        return _safe_divide(joint, marginal_t[:, :, :, None])

    def reverse_rates(self, t: Tensor) -> Tensor:
        """R_y(k -> j) = R(j -> k) q_t(j | y) / q_t(k | y), [N, V(y), K(k), K(j)]."""
        marginal = self.marginal(t)
        forward = self.rates(t).transpose(1, 2)[:, None]               # [N, 1, K(k), K(j)] = R(j -> k)
        return _safe_divide(forward * marginal[:, :, None, :], marginal[:, :, :, None])


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, 0 where the denominator is 0 (impossible conditioning events)."""
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)


def _integral_of_beta_kernel(k: int, length: int, low: float, high: float) -> float:
    """integral_low^high (1 - a)^(k-1) a^(length-k) da, by binomial expansion (small L)."""
    total = 0.0
    for j in range(k):
        power = length - k + j + 1
        total += math.comb(k - 1, j) * (-1) ** j * (high**power - low**power) / power
    return total


def _endpoint_alphas(schedule: Schedule) -> tuple[float, float]:
    """(alpha(0), alpha(1)) as floats."""
    alpha = schedule.alpha(torch.tensor([0.0, 1.0], dtype=torch.float64))
    return float(alpha[0]), float(alpha[1])


class EnumerableDistribution(Denoiser):
    """A distribution over sequences in {0..V-1}^L given by its probability table.

    ``probs[i]`` is the probability of the i-th sequence in lexicographic order
    (``itertools.product(range(V), repeat=L)``). Meant for V^L up to a few thousand.
    As a ``Denoiser`` it is the optimal one of ``AbsorbingDiffusion``: its exact conditionals.
    """

    def __init__(self, probs: Tensor, vocab_size: int, seq_len: int) -> None:
        if probs.shape != (vocab_size**seq_len,):
            raise ValueError(f"probs must have shape [{vocab_size}**{seq_len}], got {tuple(probs.shape)}")
        if bool((probs < 0).any()) or not math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9):
            raise ValueError("probs must be non-negative and sum to 1")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.probs = probs.to(torch.float64)
        self.sequences = torch.tensor(
            list(itertools.product(range(vocab_size), repeat=seq_len)), dtype=torch.long)
        self._onehot = torch.nn.functional.one_hot(self.sequences, vocab_size).to(torch.float64)

    @classmethod
    def random(cls, vocab_size: int, seq_len: int, generator: torch.Generator,
               spread: float = 2.0) -> "EnumerableDistribution":
        """softmax(spread * N(0, 1)) over all sequences: peaked, correlated, full support."""
        logits = spread * torch.randn(vocab_size**seq_len, generator=generator, dtype=torch.float64)
        return cls(torch.softmax(logits, 0), vocab_size, seq_len)

    # ------------------------------------------------------------------ exact quantities
    def index_of(self, x: Tensor) -> Tensor:
        """Row index of each sequence of ``x`` [B, L] in the table."""
        place = self.vocab_size ** torch.arange(self.seq_len - 1, -1, -1)
        return (x.cpu() * place).sum(-1)

    def log_prob(self, x: Tensor) -> Tensor:
        """Exact log p(x) per sequence, float64."""
        return self.probs[self.index_of(x)].log()

    def entropy(self) -> float:
        """The exact entropy H(p) in nats: the lowest any bound on -log p can average."""
        p = self.probs[self.probs > 0]
        return float(-(p * p.log()).sum())

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """``num_samples`` sequences [N, L] drawn from p."""
        index = torch.multinomial(self.probs, num_samples, replacement=True, generator=generator)
        return self.sequences[index]

    def conditional_logits(self, z: Tensor) -> Tensor:
        """log p(x_n = v | unmasked tokens of z) for every position: [B, L, V] (float64).

        Positions already unmasked get the point mass on their token, like any denoiser
        whose prediction there is ignored (SUBS carry-over).
        """
        mask_id = self.vocab_size
        z = z.cpu()
        consistent = ((z[:, None, :] == mask_id) | (z[:, None, :] == self.sequences[None])).all(-1)
        weights = consistent.to(torch.float64) * self.probs[None, :]               # [B, S]
        joint = torch.einsum("bs,slv->blv", weights, self._onehot)                 # [B, L, V]
        return joint.log() - weights.sum(-1).log()[:, None, None]

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        """The optimal denoiser of ``AbsorbingDiffusion``: the exact conditionals, whatever t."""
        return self.conditional_logits(z_t).to(z_t.device)

    @property
    def time_independent(self) -> bool:
        """The absorbing process's optimal denoiser ignores t: samplers may reuse its outputs."""
        return True

    def given_clean(self, x0: Tensor, block_size: int) -> Denoiser:
        """Block diffusion's optimal denoiser (``model.block_diffusion.BlockDenoiser``): block b
        of z is predicted by p(x^b_n | unmasked tokens of z^b, x0^<b), the blocks after b unseen."""
        def denoiser(z: Tensor, t: Tensor | None) -> Tensor:
            out = torch.empty(*z.shape, self.vocab_size, dtype=torch.float64)
            for start in range(0, self.seq_len, block_size):
                end = start + block_size
                # clean prefix, block b as noised, everything after it masked (marginalized out)
                seen = torch.cat([x0[:, :start].cpu(), z[:, start:end].cpu(),
                                  torch.full_like(z[:, end:].cpu(), self.vocab_size)], dim=1)
                out[:, start:end] = self.conditional_logits(seen)[:, start:end]
            return out.to(z.device)
        return FunctionDenoiser(denoiser, time_independent=True)

    # ------------------------------------------------------------------ exact bounds
    def _masked_nll_by_pattern(self, x: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """For every mask pattern M of the scored positions (bool [L], None: all): CE(M) per
        sequence [P, B] and |M| [P]. The other positions are never masked."""
        patterns = torch.tensor(list(itertools.product([False, True], repeat=self.seq_len)))
        if positions is not None:
            patterns = patterns[~(patterns & ~positions.cpu()).any(-1)]
        nll = torch.empty(len(patterns), x.shape[0], dtype=torch.float64)
        for i, mask in enumerate(patterns):
            z = torch.where(mask[None, :], self.vocab_size, x.cpu())
            logp = self.conditional_logits(z).gather(-1, x.cpu()[..., None]).squeeze(-1)
            nll[i] = -(logp * mask[None, :]).sum(-1)
        return nll, patterns.sum(-1, dtype=torch.float64)  # float64: a ** LongTensor would be float32

    def _endpoint_terms(self, nll: Tensor, num_masked: Tensor, schedule: Schedule, length: int) -> Tensor:
        alpha0, alpha1 = _endpoint_alphas(schedule)
        pattern_prob = (1 - alpha0) ** num_masked * alpha0 ** (length - num_masked)
        reconstruction = (pattern_prob.to(torch.float64)[:, None] * nll).sum(0)
        return reconstruction + length * alpha1 * math.log(self.vocab_size)

    def exact_nelbo(self, x: Tensor, schedule: Schedule, positions: Tensor | None = None) -> Tensor:
        """The expectation of ``AbsorbingDiffusion.nelbo`` with this denoiser, per sequence.

        ``positions`` (bool [L], the same for every sequence) scores only its True positions and
        keeps the others visible, as ``nelbo(..., positions=)`` does: the conditional bound on
        -log p(x at positions | x elsewhere), which with these exact conditionals it equals up
        to the endpoint guard."""
        nll, num_masked = self._masked_nll_by_pattern(x, positions)
        length = self.seq_len if positions is None else int(positions.sum())
        alpha0, alpha1 = _endpoint_alphas(schedule)
        coefficient = torch.tensor(
            [_integral_of_beta_kernel(int(k), length, alpha1, alpha0) if k > 0 else 0.0
             for k in num_masked], dtype=torch.float64)
        return (coefficient[:, None] * nll).sum(0) + self._endpoint_terms(nll, num_masked, schedule, length)

    def exact_nelbo_discrete(self, x: Tensor, schedule: Schedule, steps: int) -> Tensor:
        """The expectation of ``AbsorbingDiffusion.nelbo_discrete`` with this denoiser."""
        nll, num_masked = self._masked_nll_by_pattern(x)
        grid = torch.arange(steps + 1, dtype=torch.float64) / steps
        alpha = schedule.alpha(grid)
        total = torch.zeros(x.shape[0], dtype=torch.float64)
        for i in range(1, steps + 1):
            a_t, a_s = float(alpha[i]), float(alpha[i - 1])
            pattern_prob = (1 - a_t) ** num_masked * a_t ** (self.seq_len - num_masked)
            total += (a_s - a_t) / (1 - a_t) * (pattern_prob.to(torch.float64)[:, None] * nll).sum(0)
        return total + self._endpoint_terms(nll, num_masked, schedule, self.seq_len)

    # ------------------------------------------------------------------ any process
    def exact_denoiser(self, process: DiffusionProcess, known: Tensor | None = None) -> DenoiserFunction:
        """The exact posterior P(x_n = v | z_t) under ``process``'s forward process, as a
        denoiser ``(z_t, t) -> log-probabilities [B, L, V]`` (float64, time-dependent).

        ``known`` (bool [L]) marks positions whose z is the clean token itself (a prompt the
        sampler keeps): their likelihood is the point mass rather than the forward channel.
        """
        channel = _Channel(process)

        def denoiser(z: Tensor, t: Tensor) -> Tensor:
            marginal = channel.marginal(t.detach().reshape(-1).cpu())               # [B, V, K]
            index = z.cpu()[:, None, :].expand(-1, self.vocab_size, -1)
            log_likelihood = marginal.gather(2, index).log().transpose(1, 2)         # [B, L, V]
            if known is not None:
                exact = torch.where(z.cpu()[..., None] == torch.arange(self.vocab_size), 0.0, -math.inf)
                log_likelihood = torch.where(known.cpu()[:, None], exact, log_likelihood)
            return self._posterior_logits(log_likelihood).to(z.device)

        return denoiser

    def _posterior_logits(self, log_likelihood: Tensor) -> Tensor:
        """log P(x_n = v | z) [B, L, V] for P(x | z) proportional to p(x) prod_n likelihood[n, x_n]."""
        position = torch.arange(self.seq_len)
        out = []
        for chunk in log_likelihood.split(CHUNK_ROWS):
            per_sequence = chunk[:, position, self.sequences].sum(-1)                # [b, S]
            weights = torch.softmax(self.probs.log() + per_sequence, dim=-1)
            out.append(torch.einsum("bs,slv->blv", weights, self._onehot).log())
        return torch.cat(out)

    def _noisy_states(self, channel: _Channel) -> Tensor:
        """Every z in {0..K-1}^L, lexicographic, [K^L, L]."""
        return torch.tensor(list(itertools.product(range(channel.states), repeat=self.seq_len)), dtype=torch.long)

    def _prediction(self, channel: _Channel, denoiser: DenoiserLike, states: Tensor, t: Tensor) -> Tensor:
        """mu'[N, Z, L, V]: softmax of the denoiser at every state and time, restricted to the
        clean values that can produce z_n at t (carry-over: the token itself where unmasked)."""
        times, count = t.shape[0], states.shape[0]
        rows = states.repeat(times, 1)
        row_times = t.repeat_interleave(count)
        denoiser = as_denoiser(denoiser)
        with torch.no_grad():
            logits = torch.cat([denoiser.logits(z, tt)
                                for z, tt in zip(rows.split(CHUNK_ROWS), row_times.split(CHUNK_ROWS))])
        mu = torch.softmax(logits.to(torch.float64).cpu(), dim=-1).view(times, count, self.seq_len, -1)
        possible = channel.marginal(t)[:, None, :, :].expand(-1, count, -1, -1).gather(
            3, states[None, :, None, :].expand(times, -1, self.vocab_size, -1)).transpose(2, 3) > 0
        mu = mu * possible
        return mu / mu.sum(-1, keepdim=True)

    def _state_probs(self, marginal: Tensor, states: Tensor, x: Tensor) -> Tensor:
        """q_t(z | x) = prod_n marginal[x_n, z_n], [N, Z, X]."""
        return marginal[:, x[None, :, :], states[:, None, :]].prod(-1)

    def _expected_divergence(self, channel: _Channel, denoiser: DenoiserLike, x: Tensor, t: Tensor,
                             s: Tensor | None) -> Tensor:
        """E_{z_t ~ q(.|x)} sum_n of the rate divergence (s=None) or of the step KL from t to s,
        [N, X]."""
        states = self._noisy_states(channel)
        mu = self._prediction(channel, denoiser, states, t)                          # [N, Z, L, V]
        kernel = channel.reverse_rates(t) if s is None else channel.posterior(s, t)  # [N, V, K, K]
        model = torch.einsum("nzly,nyzlk->nzlk", mu, kernel[:, :, states, :])
        truth = kernel[:, x[None, :, :], states[:, None, :], :]                      # [N, Z, X, L, K]
        model = model[:, :, None]
        divergence = torch.xlogy(truth, truth) - torch.xlogy(truth, model)
        if s is None:  # generalized KL of rates
            divergence = divergence + model - truth
        probability = self._state_probs(channel.marginal(t), states, x)
        return torch.where(probability > 0, probability * divergence.sum((-1, -2)), 0.0).sum(1)

    def _exact_endpoints(self, channel: _Channel, denoiser: DenoiserLike, x: Tensor) -> Tensor:
        """Reconstruction by the denoiser at t = 0 plus KL(q(z_1 | x) || p(z_1)), per sequence."""
        zero = torch.zeros(1, dtype=torch.float64)
        states = self._noisy_states(channel)
        mu = self._prediction(channel, denoiser, states, zero)[0]                    # [Z, L, V]
        log_mu = mu[:, torch.arange(self.seq_len)[None, :], x].log()                 # [Z, X, L]
        probability = self._state_probs(channel.marginal(zero), states, x)[0]
        reconstruction = torch.where(probability > 0, -probability * log_mu.sum(-1), 0.0).sum(0)
        end = channel.marginal(torch.ones(1, dtype=torch.float64))[0]                # [V, K]
        token_kl = (torch.xlogy(end, end) - torch.xlogy(end, channel.prior())).sum(-1)
        return reconstruction + token_kl[x].sum(-1)

    def exact_process_nelbo(self, x: Tensor, process: DiffusionProcess,
                            denoiser: DenoiserLike | None = None) -> Tensor:
        """The expectation of ``process.nelbo(denoiser, x)`` (default: the exact posterior),
        per sequence, from the forward matrices (module docstring), float64 [B]."""
        channel, x = _Channel(process), x.cpu()
        denoiser = denoiser or self.exact_denoiser(process)
        nodes, weights = _dyadic_gauss_legendre()
        total = torch.zeros(x.shape[0], dtype=torch.float64)
        for t, w in zip(nodes.split(NODES_PER_CHUNK), weights.split(NODES_PER_CHUNK)):
            total += (w[:, None] * self._expected_divergence(channel, denoiser, x, t, None)).sum(0)
        return total + self._exact_endpoints(channel, denoiser, x)

    def exact_process_nelbo_discrete(self, x: Tensor, process: DiffusionProcess, steps: int,
                                     denoiser: DenoiserLike | None = None) -> Tensor:
        """The expectation of ``process.nelbo_discrete(denoiser, x, steps)`` (default: the
        exact posterior), per sequence, float64 [B]."""
        channel, x = _Channel(process), x.cpu()
        denoiser = denoiser or self.exact_denoiser(process)
        grid = torch.arange(steps + 1, dtype=torch.float64) / steps
        total = torch.zeros(x.shape[0], dtype=torch.float64)
        for t, s in zip(grid[1:].split(NODES_PER_CHUNK), grid[:-1].split(NODES_PER_CHUNK)):
            total += self._expected_divergence(channel, denoiser, x, t, s).sum(0)
        return total + self._exact_endpoints(channel, denoiser, x)

    def sampler_law(self, process: DiffusionProcess, denoiser: DenoiserLike, steps: int,
                    grid: str = "uniform", prompt: Tensor | None = None) -> Tensor:
        """The exact distribution [V^L] over clean sequences of ``process.sample(denoiser, ...,
        steps, grid=grid, prompt=prompt)`` without top_p, from the mixture-of-posteriors kernel
        of the forward matrices: prompt positions (ids < V) are kept, the others start from the
        prior (the mask, or Uniform(V)) and change by p(z_s^n | z_t); the last step draws from mu'."""
        channel = _Channel(process)
        states = self._noisy_states(channel)
        free = torch.ones(self.seq_len, dtype=torch.bool) if prompt is None else prompt.cpu() == self.vocab_size
        start = _start_law(channel, free, prompt, self.seq_len)                      # [L, K]
        law = start[torch.arange(self.seq_len), states].prod(-1)                     # [Z]
        times = time_grid(steps, grid)
        for step in range(steps):
            t, s = times[step:step + 1], times[step + 1:step + 2]
            mu = self._prediction(channel, denoiser, states, t)[0]                   # [Z, L, V]
            if step == steps - 1:
                kernel = torch.nn.functional.pad(mu, (0, channel.states - self.vocab_size))
            else:
                kernel = torch.einsum("zly,yzlk->zlk", mu, channel.posterior(s, t)[0][:, states, :])
            stay = torch.nn.functional.one_hot(states, channel.states).to(torch.float64)
            kernel = torch.where(free[None, :, None], kernel, stay)                  # [Z, L, K]
            law = law @ kernel[:, torch.arange(self.seq_len)[None, :], states].prod(-1)
        clean = (states < self.vocab_size).all(-1)
        return law[clean]

    def first_hitting_law(self, process: AbsorbingDiffusion, denoiser: DenoiserLike,
                          prompt: Tensor | None = None) -> Tensor:
        """The exact distribution [V^L] of ``model.sampling.first_hitting_sample`` (one token per
        call, no top_p) with a time-independent ``denoiser`` mu(z), over clean sequences.

        Each of the n positions to generate unmasks at an independent time with P(tau < s) =
        r(s) / r(1), so the K positions whose time falls below t = 0 are Binomial(n, r(0) / r(1))
        and the others are revealed in a uniformly random order, each from mu of the state
        before it; then the K left are filled at once from mu of the last state:

            law = sum_k Binom(k; n, q) Fill(Reveal^(n - k) start),   q = r(0) / r(1).
        """
        channel = _Channel(process)
        states = self._noisy_states(channel)                                         # [Z, L]
        mu = self._prediction(channel, denoiser, states, torch.zeros(1, dtype=torch.float64))[0]  # [Z, L, V]
        free = torch.ones(self.seq_len, dtype=torch.bool) if prompt is None else prompt.cpu() == self.vocab_size
        start = _start_law(channel, free, prompt, self.seq_len)
        law = start[torch.arange(self.seq_len), states].prod(-1)                     # [Z]
        reveal = self._reveal_matrix(states, mu)                                     # [Z, Z]
        fill = mu[:, torch.arange(self.seq_len)[None, :], self.sequences].prod(-1)   # [Z, S]
        rates = process.schedule.masking_rate(torch.tensor([0.0, 1.0], dtype=torch.float64))
        late, n = float(rates[0] / rates[1]), int(free.sum())
        total = torch.zeros(len(self.sequences), dtype=torch.float64)
        for revealed in range(n + 1):
            total += math.comb(n, revealed) * (1 - late) ** revealed * late ** (n - revealed) * (law @ fill)
            law = law @ reveal
        return total

    def _reveal_matrix(self, states: Tensor, mu: Tensor) -> Tensor:
        """[Z, Z]: from state z, one of its m masked positions chosen uniformly is set to v with
        probability mu(z)[n, v] / m; states without a mask stay."""
        mask, count = self.vocab_size, states.shape[0]
        place = (mask + 1) ** torch.arange(self.seq_len - 1, -1, -1)                 # base K = V + 1
        matrix = torch.zeros(count, count, dtype=torch.float64)
        for index, z in enumerate(states):
            masked = (z == mask).nonzero().flatten().tolist()
            if not masked:
                matrix[index, index] = 1.0
            for n in masked:
                for v in range(self.vocab_size):
                    matrix[index, index + (v - mask) * int(place[n])] += float(mu[index, n, v]) / len(masked)
        return matrix


def _start_law(channel: _Channel, free: Tensor, prompt: Tensor | None, length: int) -> Tensor:
    """Per position, the law of z at t = 1 in the sampler: the prior's start state (the mask, or
    Uniform(V)) where free, the prompt token elsewhere; [L, K]."""
    start = torch.zeros(length, channel.states, dtype=torch.float64)
    if channel.uniform:
        start[free] = 1.0 / channel.vocab_size
    else:
        start[free, -1] = 1.0
    if prompt is not None:
        kept = ~free
        start[kept] = torch.nn.functional.one_hot(prompt.cpu()[kept], channel.states).to(torch.float64)
    return start


def conditional_nll(oracle: EnumerableDistribution, tokens: Tensor, positions: Tensor) -> float:
    """-log p(the real tokens | the padding, visible), exactly, summed over the sequences of the
    table's length that ``tokens`` [..., k * L] and its ``positions`` (True where real) hold."""
    total = 0.0
    for x, real in zip(tokens.reshape(-1, oracle.seq_len), positions.reshape(-1, oracle.seq_len)):
        consistent = (oracle.sequences[:, ~real] == x[~real]).all(-1)
        total += float(-oracle.log_prob(x[None])[0] + oracle.probs[consistent].sum().log())
    return total

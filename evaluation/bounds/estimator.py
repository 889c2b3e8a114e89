"""The zero-shot bound estimator: an evaluation set's NELBO per token, with its standard error.

    blocks = wrap_blocks(token_ids_per_document, 1024, eos_id=eos, pad_id=eos)
    estimate = estimate_bound(diffusion, network.eval(), blocks, samples_per_block=16)
    estimate.perplexity_bound, estimate.perplexity_interval(), estimate.bits_per_byte(utf8_bytes)

Invariants: every real token is scored exactly once (padding is never masked nor scored);
K replicates of one (t, z_t) per block, times stratified over the blocks in a random order, each
replicate an unbiased estimate of the set's total; the standard error comes from the K
replicate totals (K - 1 degrees of freedom; with K = 1 from the blocks, conservatively). The
numbers do not depend on ``batch_size``, the device or the ranks: block i of replicate k draws
from its own generator (seed, k, i), and ``all_reduce`` sums the ranks' shares. The denoiser
should be in eval mode; the caller chooses autocast. ``autoregressive_nll`` is exact (SE 0).
Why this design, and the coverage of the interval: docs/evaluation.md#how-the-bound-is-estimated
(the estimate itself: docs/math.md#reporting, its times: docs/math.md#low-discrepancy-times).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor

from common.units import NATS_PER_BIT
from model.autoregressive import Autoregressive, CausalNetwork
from model.checks import check_token_ids
from model.denoiser import DenoiserLike
from model.generators import seeded_generators
from model.process import DiffusionProcess, NelboTerms, low_discrepancy_times

__all__ = ["Blocks", "BoundEstimate", "TimeContributions", "Z_95", "autoregressive_nll",
           "estimate_bound", "per_time_contributions", "replicate_terms", "wrap_blocks"]

AllReduce = Callable[[list[float]], list[float]]

Z_95 = 1.959964  # two-sided 95% quantile of the standard normal
# Spawn keys of the random streams of a replicate: its times, its masks, its subset of blocks.
_TIME_STREAM, _MASK_STREAM, _SUBSET_STREAM = 0, 1, 2
Progress = Callable[[int], None]
_MIN_REPLICATES_FOR_TARGET = 8  # stop on an SE with >= 7 degrees of freedom, not on a lucky 1


def _identity(values: list[float]) -> list[float]:
    return list(values)


# ------------------------------------------------------------------------------ blocks
@dataclass(frozen=True)
class Blocks:
    """Evaluation blocks: token ids and which of them are real tokens to score."""

    tokens: Tensor     # LongTensor [N, L]
    positions: Tensor  # BoolTensor [N, L]: True where a real token is scored, False = padding

    def __post_init__(self) -> None:
        # Ranges are the model's to check (AbsorbingDiffusion, Autoregressive): it knows V.
        check_token_ids(self.tokens, "Blocks.tokens", 0, check_values=False)
        if not isinstance(self.positions, Tensor) or self.positions.dtype != torch.bool:
            raise ValueError("Blocks.positions must be a BoolTensor")
        if self.positions.shape != self.tokens.shape:
            raise ValueError(f"Blocks.positions has shape {tuple(self.positions.shape)}, "
                             f"tokens {tuple(self.tokens.shape)}")

    @property
    def num_blocks(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        """The number of scored (real) tokens."""
        return int(self.positions.sum())


def wrap_blocks(documents: list[list[int]], seq_len: int, *, eos_id: int, pad_id: int,
                add_eos: bool = True) -> Blocks:
    """Concatenate documents (each followed by EOS when add_eos), cut into seq_len blocks.

    The last partial block is padded with ``pad_id`` and its padding excluded (positions
    False). Every token is scored exactly once; nothing is dropped.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if not documents:
        raise ValueError("wrap_blocks got no documents")
    suffix = [eos_id] if add_eos else []
    stream = torch.tensor(list(chain.from_iterable(list(doc) + suffix for doc in documents)),
                          dtype=torch.long)
    if stream.numel() == 0:
        raise ValueError("wrap_blocks got only empty documents and add_eos=False: no token to score")
    num_blocks = -(-stream.numel() // seq_len)
    tokens = torch.full((num_blocks * seq_len,), pad_id, dtype=torch.long)
    tokens[:stream.numel()] = stream
    positions = torch.arange(num_blocks * seq_len) < stream.numel()
    return Blocks(tokens.view(num_blocks, seq_len), positions.view(num_blocks, seq_len))


# ------------------------------------------------------------------------------ result
@dataclass(frozen=True)
class BoundEstimate:
    """The bound per token of an evaluation set and its Monte Carlo standard error."""

    nelbo_per_token: float       # nats: mean_k S_k / num_tokens
    standard_error: float        # of nelbo_per_token (NaN when it cannot be estimated)
    num_tokens: int
    num_blocks: int
    samples_per_block: int       # K, (t, z_t) samples per block (1 for the exact AR pass)
    kind: str                    # "continuous" | "discrete" | "autoregressive" (exact, SE 0)
    discrete_steps: int | None
    seed: int | None = None
    error_method: str = "replicates"  # "replicates" | "blocks" (K = 1, conservative) | "exact"

    @property
    def perplexity_bound(self) -> float:
        return math.exp(self.nelbo_per_token)

    @property
    def degrees_of_freedom(self) -> int | None:
        """Of the standard error estimate: K - 1 for replicates, N - 1 for blocks."""
        return {"replicates": self.samples_per_block - 1,
                "blocks": self.num_blocks - 1}.get(self.error_method)

    def perplexity_interval(self, z: float = Z_95) -> tuple[float, float]:
        """exp(nelbo_per_token -/+ z * SE): the Monte Carlo interval of the perplexity bound."""
        return (math.exp(self.nelbo_per_token - z * self.standard_error),
                math.exp(self.nelbo_per_token + z * self.standard_error))

    def bits_per_byte(self, utf8_bytes: int) -> float:
        """Total NELBO in bits over the UTF-8 bytes of the detokenized evaluation text."""
        if utf8_bytes <= 0:
            raise ValueError(f"utf8_bytes must be positive, got {utf8_bytes}")
        return self.nelbo_per_token * self.num_tokens / (NATS_PER_BIT * utf8_bytes)

    def to_dict(self) -> dict:
        low, high = self.perplexity_interval()
        return {**asdict(self), "perplexity_bound": self.perplexity_bound,
                "perplexity_interval_95": [low, high], "degrees_of_freedom": self.degrees_of_freedom}


class TimeContributions(NamedTuple):
    """One record per scored (replicate, block) of this rank, in work order."""

    t: np.ndarray                    # float64: the diffusion time of the record
    diffusion_per_token: np.ndarray  # float64: the weighted masked cross-entropy / real tokens
    block: np.ndarray                # int64: the block index


# ------------------------------------------------------------------------------ seeding
def _stream_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator for the stream (seed, *keys); independent across distinct keys."""
    return seeded_generators(seed, spawn_key=keys, seed_bits=64)[0]


def _replicate_times(num_blocks: int, seed: int, replicate: int) -> Tensor:
    """Replicate k's time of every block: stratified over the blocks, in a random order."""
    generator = _stream_generator(seed, _TIME_STREAM, replicate)
    times = low_discrepancy_times(num_blocks, generator)
    return times[torch.randperm(num_blocks, generator=generator)]


# ------------------------------------------------------------------------------ work
@dataclass(frozen=True)
class _ReplicateDesign:
    """The Monte Carlo design of this rank's passes: which blocks each replicate scores, at which
    times, in batches of what size on which device (every pass of the estimator shares it)."""

    seed: int
    batch_size: int
    device: torch.device
    rank: int
    world_size: int
    blocks_per_replicate: int | None = None   # None: every block in every replicate

    def own_blocks(self, num_blocks: int) -> Tensor:
        return torch.arange(self.rank, num_blocks, self.world_size)

    def subsampled(self, num_blocks: int) -> bool:
        return self.blocks_per_replicate is not None and self.blocks_per_replicate < num_blocks

    def subset(self, num_blocks: int, replicate: int) -> Tensor:
        """The replicate's random subset of ``blocks_per_replicate`` blocks (the same on every
        rank), in a random order."""
        generator = _stream_generator(self.seed, _SUBSET_STREAM, replicate)
        return torch.randperm(num_blocks, generator=generator)[:self.blocks_per_replicate]

    def replicate_blocks(self, num_blocks: int, replicate: int) -> Tensor:
        """The blocks this rank scores in ``replicate``: its own, or its own among the
        replicate's subset."""
        own = self.own_blocks(num_blocks)
        if not self.subsampled(num_blocks):
            return own
        return own[torch.isin(own, self.subset(num_blocks, replicate))]

    def replicate_times(self, num_blocks: int, replicate: int) -> Tensor:
        """Replicate k's time of every block [N]: stratified over the blocks it scores.

        Under a subset, the times are stratified over the subset (the other blocks' entries
        are unused): a block's time is still marginally U(0, 1), and each replicate still
        covers [0, 1) evenly. Times drawn for all N blocks and then subsampled would not: the
        subset's times would be independent uniforms, and the 1/t weight makes a term's
        variance grow like log(1 / endpoint) near t = 0, so the totals would be skewed (most
        replicates low, a few very high) and their standard error too small."""
        if not self.subsampled(num_blocks):
            return _replicate_times(num_blocks, self.seed, replicate)
        subset = self.subset(num_blocks, replicate)
        times = torch.zeros(num_blocks, dtype=torch.float64)
        times[subset] = _replicate_times(subset.numel(), self.seed, replicate).to(times.dtype)
        return times

    def block_scale(self, num_blocks: int) -> float:
        """What a replicate's sum over its subset is multiplied by to estimate the total."""
        n = self.blocks_per_replicate
        return 1.0 if n is None or n >= num_blocks else num_blocks / n


def _replicate_design(seed: int, batch_size: int, device: torch.device | str, rank: int,
               world_size: int, blocks_per_replicate: int | None = None) -> _ReplicateDesign:
    _check_int("batch_size", batch_size, minimum=1)
    if blocks_per_replicate is not None:
        _check_int("blocks_per_replicate", blocks_per_replicate, minimum=1)
    _check_int("world_size", world_size, minimum=1)
    _check_int("seed", seed, minimum=0)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return _ReplicateDesign(seed, batch_size, torch.device(device), rank, world_size, blocks_per_replicate)


def _work(blocks: Blocks, replicates: range, design: _ReplicateDesign) -> Iterator[tuple[Tensor, Tensor]]:
    """(replicate, block) index pairs of this rank in batches; the order is batch-independent."""
    chosen = [design.replicate_blocks(blocks.num_blocks, k) for k in replicates]
    ks = torch.cat([torch.full((c.numel(),), k, dtype=torch.long) for k, c in zip(replicates, chosen)])
    ids = torch.cat(chosen)
    for start in range(0, ks.numel(), design.batch_size):
        yield ks[start:start + design.batch_size], ids[start:start + design.batch_size]


def _score_batches(diffusion: DiffusionProcess, denoiser: DenoiserLike, blocks: Blocks,
                   replicates: range, design: _ReplicateDesign, discrete_steps: int | None, keys: _Keys | None = None,
                   ) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor | NelboTerms]]:
    """Yield (replicate, block, u, result) per batch: result is the NelboTerms (continuous) or
    the NELBO_T per block (discrete). ``keys``: whose draws each block takes (``replicate_terms``)."""
    slots = blocks.num_blocks if keys is None else keys.count
    times = torch.stack([design.replicate_times(slots, k) for k in replicates])
    for ks, ids in _work(blocks, replicates, design):
        draws = ids if keys is None else keys.of_blocks[ids]
        u = times[ks - replicates.start, draws]
        generators = [_stream_generator(design.seed, _MASK_STREAM, int(k), int(i)) for k, i in zip(ks, draws)]
        x0 = blocks.tokens[ids].to(design.device)
        positions = blocks.positions[ids].to(design.device)
        if discrete_steps is None:
            result = diffusion.nelbo_terms(denoiser, x0, u, generators, positions=positions)
        else:
            result = diffusion.nelbo_discrete(denoiser, x0, discrete_steps, generators, u=u,
                                              positions=positions)
        yield ks, ids, u, result


@torch.no_grad()
def _replicate_partials(diffusion: DiffusionProcess, denoiser: DenoiserLike, blocks: Blocks,
                        replicates: range, design: _ReplicateDesign, discrete_steps: int | None,
                        progress: Progress | None = None) -> list[float]:
    """This rank's share of S_k = sum_blocks NELBO_k and Q_k = sum_blocks NELBO_k^2, for k in
    ``replicates``, as [S..., Q...] (a sum over ranks gives the totals)."""
    slots, terms = [], []
    for ks, _, _, result in _score_batches(diffusion, denoiser, blocks, replicates, design, discrete_steps):
        # Kept on the device and read once at the end: the host prepares the next batch while
        # the device scores this one.
        slots.append(ks - replicates.start)
        terms.append(result.total if isinstance(result, NelboTerms) else result)
        if progress is not None:
            progress(len(ks))
    sums = np.zeros(len(replicates), dtype=np.float64)
    squares = np.zeros(len(replicates), dtype=np.float64)
    if terms:
        slot, nelbo = torch.cat(slots).numpy(), torch.cat([t.to(torch.float64) for t in terms]).cpu().numpy()
        np.add.at(sums, slot, nelbo)
        np.add.at(squares, slot, nelbo**2)
    return [*(sums * design.block_scale(blocks.num_blocks)).tolist(), *squares.tolist()]


def _summarize(sums: list[float], squares: list[float], blocks: Blocks, kind: str,
               discrete_steps: int | None, seed: int) -> BoundEstimate:
    """The estimate and its standard error from the replicate totals
    (docs/evaluation.md#how-the-bound-is-estimated)."""
    replicates, num_blocks, num_tokens = len(sums), blocks.num_blocks, blocks.num_tokens
    totals = np.asarray(sums, dtype=np.float64)
    if replicates >= 2:
        standard_error, method = float(totals.std(ddof=1)) / math.sqrt(replicates), "replicates"
    elif num_blocks >= 2:
        # K = 1: block terms as independent draws (conservative: it counts the blocks' spread as noise).
        variance = (squares[0] - sums[0] ** 2 / num_blocks) / (num_blocks - 1)
        standard_error, method = math.sqrt(num_blocks * max(variance, 0.0)), "blocks"
    else:
        standard_error, method = math.nan, "blocks"
    return BoundEstimate(
        nelbo_per_token=float(totals.mean()) / num_tokens,
        standard_error=standard_error / num_tokens,
        num_tokens=num_tokens, num_blocks=num_blocks, samples_per_block=replicates, kind=kind,
        discrete_steps=discrete_steps, seed=seed, error_method=method)


# ------------------------------------------------------------------------------ public
def estimate_bound(diffusion: DiffusionProcess, denoiser: DenoiserLike, blocks: Blocks, *,
                   samples_per_block: int = 1, seed: int = 0, batch_size: int = 32,
                   device: torch.device | str = "cpu", discrete_steps: int | None = None,
                   target_rel_error: float | None = None, max_samples_per_block: int = 1024,
                   rank: int = 0, world_size: int = 1, all_reduce: AllReduce | None = None,
                   blocks_per_replicate: int | None = None, progress: Progress | None = None) -> BoundEstimate:
    """Monte Carlo estimate of sum_blocks NELBO / num_tokens with its standard error.

    ``samples_per_block`` K replicates of one (t, z_t) per block (module docstring);
    ``discrete_steps`` T scores the T-step bound instead of the continuous one;
    ``target_rel_error`` adds replicates (doubling K, starting from at least 8) until
    SE / nelbo_per_token <= target or K = ``max_samples_per_block``. ``rank``, ``world_size``
    and ``all_reduce`` split the blocks over data-parallel ranks; the result is the same on
    every rank and independent of ``batch_size`` and ``world_size``.

    ``progress`` is called with the number of (replicate, block) pairs this rank scored,
    after each batch (a progress bar's ``update``).

    ``blocks_per_replicate`` n (a quick look at a large set): each replicate scores a random
    subset of n blocks, drawn independently per replicate, and scales its sum by N / n. The
    replicate totals stay independent, identically distributed and unbiased for the set's
    total, so the replicate standard error, block sampling included, still holds (it needs
    K >= 2); the cost falls by N / n and the interval widens with the blocks' spread.
    """
    design = _replicate_design(seed, batch_size, device, rank, world_size, blocks_per_replicate)
    _check_int("samples_per_block", samples_per_block, minimum=1)
    _check_int("max_samples_per_block", max_samples_per_block, minimum=1)
    if blocks_per_replicate is not None and samples_per_block < 2:
        raise ValueError("blocks_per_replicate needs samples_per_block >= 2: its error comes from the replicates")
    if discrete_steps is not None:
        _check_int("discrete_steps", discrete_steps, minimum=1)
    if samples_per_block > max_samples_per_block:
        raise ValueError(f"samples_per_block={samples_per_block} exceeds "
                         f"max_samples_per_block={max_samples_per_block}")
    if target_rel_error is not None:
        if not target_rel_error > 0:
            raise ValueError(f"target_rel_error must be positive, got {target_rel_error!r}")
        samples_per_block = min(max(samples_per_block, _MIN_REPLICATES_FOR_TARGET), max_samples_per_block)
    _check_scorable(blocks)
    all_reduce = all_reduce or _identity
    kind = "continuous" if discrete_steps is None else "discrete"
    sums: list[float] = []
    squares: list[float] = []
    done, wanted = 0, samples_per_block
    while True:
        new = range(done, wanted)
        reduced = all_reduce(_replicate_partials(diffusion, denoiser, blocks, new, design, discrete_steps, progress))
        sums += reduced[:len(new)]
        squares += reduced[len(new):]
        done = wanted
        estimate = _summarize(sums, squares, blocks, kind, discrete_steps, seed)
        if (target_rel_error is None or done >= max_samples_per_block
                or estimate.standard_error <= target_rel_error * abs(estimate.nelbo_per_token)):
            return estimate
        wanted = min(2 * done, max_samples_per_block)


class _Keys(NamedTuple):
    of_blocks: Tensor   # LongTensor [N]: each block's key
    count: int          # M: keys are 0..M-1


@torch.no_grad()
def replicate_terms(diffusion: DiffusionProcess, denoiser: DenoiserLike, blocks: Blocks, *,
                    samples_per_block: int = 1, seed: int = 0, batch_size: int = 32,
                    device: torch.device | str = "cpu", progress: Progress | None = None,
                    keys: Tensor | None = None, num_keys: int | None = None) -> np.ndarray:
    """Every block's term in every replicate, float64 [K, N]: NELBO_k(block i) at [k, i].

    The (t, z_t) are exactly those of ``estimate_bound`` with the same seed (one process), so
    the row sums are its replicate totals S_k. A caller that needs blocks one by one (each
    block an lm-eval request) takes the mean over k of a column, an unbiased bound for that
    block, and its replicate standard error std_k / sqrt(K): the replicates are independent
    and identically distributed for every block and every subset of blocks alike.

    ``keys`` (LongTensor [N] in [0, ``num_keys``)): common random numbers. Blocks with the same
    key take the same draws in every replicate: the key's time, stratified over the M keys as
    block times are over blocks, and the key's mask uniforms, position by position (blocks of
    different lengths share the uniforms of the positions they both have). A key's draws depend
    only on seed, k, M and the key, so calls with the same seed and M share them too. Each
    block's terms stay an unbiased bound; only the correlations between blocks change (the
    difference of two choices that share a context loses most of its noise). None: key i is
    block i, as above.
    """
    design = _replicate_design(seed, batch_size, device, 0, 1)
    _check_int("samples_per_block", samples_per_block, minimum=1)
    _check_scorable(blocks)
    shared = None
    if keys is not None:
        _check_int("num_keys", num_keys, minimum=1)
        if keys.shape != (blocks.num_blocks,) or bool((keys < 0).any()) or bool((keys >= num_keys).any()):
            raise ValueError(f"keys must be a LongTensor [{blocks.num_blocks}] with values in [0, {num_keys})")
        shared = _Keys(keys.long(), num_keys)
    terms = np.zeros((samples_per_block, blocks.num_blocks), dtype=np.float64)
    for ks, ids, _, result in _score_batches(diffusion, denoiser, blocks, range(samples_per_block), design,
                                             discrete_steps=None, keys=shared):
        terms[ks.numpy(), ids.numpy()] = result.total.cpu().numpy()
        if progress is not None:
            progress(len(ks))
    return terms


@torch.no_grad()
def per_time_contributions(diffusion: DiffusionProcess, denoiser: DenoiserLike, blocks: Blocks, *,
                           samples_per_block: int = 1, seed: int = 0, batch_size: int = 32,
                           device: torch.device | str = "cpu", rank: int = 0,
                           world_size: int = 1) -> TimeContributions:
    """For each (replicate, block) of this rank: its time t and its diffusion term per real token.

    The (t, z_t) are exactly those of ``estimate_bound`` with the same seed (continuous), so
    a plot of the contribution against the masking rate 1 - alpha(t) explains that number.
    Blocks without a real token are left out. Gathering the ranks' records is the caller's.
    """
    design = _replicate_design(seed, batch_size, device, rank, world_size)
    _check_int("samples_per_block", samples_per_block, minimum=1)
    real = blocks.positions.sum(-1, dtype=torch.float64)
    records: list[tuple[Tensor, Tensor, Tensor]] = []
    for _, ids, u, terms in _score_batches(diffusion, denoiser, blocks, range(samples_per_block),
                                           design, discrete_steps=None):
        keep = real[ids] > 0
        records.append((u[keep], terms.diffusion.cpu()[keep] / real[ids][keep], ids[keep]))
    if not records:  # a rank without blocks
        return TimeContributions(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    t, per_token, block = (torch.cat(column).numpy() for column in zip(*records))
    return TimeContributions(t, per_token, block)


@torch.no_grad()
def autoregressive_nll(autoregressive: Autoregressive, network: CausalNetwork, blocks: Blocks, *,
                       batch_size: int = 32, device: torch.device | str = "cpu", rank: int = 0,
                       world_size: int = 1, all_reduce: AllReduce | None = None) -> BoundEstimate:
    """Exact -log p per real token of a causal ``network`` (padding not scored); SE 0."""
    design = _replicate_design(0, batch_size, device, rank, world_size)
    _check_scorable(blocks)
    total = 0.0
    for _, ids in _work(blocks, range(1), design):
        x0, positions = blocks.tokens[ids].to(design.device), blocks.positions[ids].to(design.device)
        total += float(autoregressive.nll(network, x0, positions).sum())
    (total,) = (all_reduce or _identity)([total])
    return BoundEstimate(
        nelbo_per_token=total / blocks.num_tokens, standard_error=0.0,
        num_tokens=blocks.num_tokens, num_blocks=blocks.num_blocks, samples_per_block=1,
        kind="autoregressive", discrete_steps=None, seed=None, error_method="exact")


# ------------------------------------------------------------------------------ checks
def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_scorable(blocks: Blocks) -> None:
    if not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be evaluation.bounds.estimator.Blocks, got {type(blocks).__name__}")
    if blocks.num_tokens == 0:
        raise ValueError("blocks hold no real token to score (positions are all False)")

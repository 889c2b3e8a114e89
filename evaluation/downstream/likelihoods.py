"""Log-likelihoods of continuations and of whole documents, from any model: the questions
lm-evaluation-harness asks a language model (``evaluation.downstream.lm_eval_model`` asks them here).

    model = ScoringModel.of(load_export("runs/tiny/export"), torch.device("cpu"))
    settings = ScoringSettings(samples=16, seed=0)
    scores = score_continuations(model, [(context_ids, continuation_ids)], settings)
    scores[0].log_likelihood, scores[0].standard_error, scores[0].is_greedy
    documents = score_documents(model, [document_ids], settings, eos_id=eos, pad_id=eos)

A diffusion model's continuation gets its conditional ELBO, a lower bound on log p(c | x) with
the context never noised, estimated as the zero-shot estimator estimates a bound
(``evaluation.bounds.estimator.replicate_terms``: K replicates, independent, so the standard
error is honest for each request and any sum of them); the choices of one context share their
draws (common random numbers). ``is_greedy`` is an approximation for diffusion models. An
autoregressive model is exact (standard error 0). A document is scored as ``unmask eval``
scores a dataset. Requests are scored in groups of equal length (no padding a bidirectional
model would see); every generator lives on the host, so the numbers depend neither on the
device nor on the batch. Why, and the variance: docs/downstream.md#how-a-diffusion-model-answers-lm-eval.
With ``guidance`` w (LLaDA's), a continuation is scored by the same estimator on the guided logits
cond + w (cond - un), un with the context masked: a score that ranks choices, not a bound on
log p; two forward passes per call (docs/fast-generation.md#guided-loglikelihood).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from common.errors import UserError
from common.progress import bar as progress_bar
from evaluation.bounds.estimator import Blocks, replicate_terms, wrap_blocks
from evaluation.inference import inference_mode
from model.autoregressive import Autoregressive
from model.denoiser import Denoiser, DenoiserLike, as_denoiser
from model.positions import sum_by_row
from model.process import DiffusionProcess
from model.spec import Process
from model.transformer import TransformerConfig
from pipeline.interchange.export import Exported
from pipeline.training.engine import activation_memory_bytes

__all__ = ["CPU_TOKENS_PER_BATCH", "GUIDED_SCORES", "ContextGuidance", "Pair", "Score", "ScoringModel",
           "ScoringSettings", "capacity_rows", "check_guidance", "score_continuations", "score_documents"]

log = logging.getLogger("unmask.lm_eval")

# Tokens per forward pass on a CPU: enough rows to amortize the per-call overhead of a small
# network, few enough that the activations stay in the caches of a laptop-class machine.
CPU_TOKENS_PER_BATCH = 8192
# Share of a GPU's free memory the estimated activations of one forward pass may take.
GPU_MEMORY_SHARE = 0.5
# More rows than this gain nothing on any GPU and make a time-conditioned batch's times coarse.
MAX_BATCH_ROWS = 4096
# What every record of a guided loglikelihood says of its numbers.
GUIDED_SCORES = "guided: ranks the choices, not a likelihood bound of the model (two forward passes a call)"
# The time at which ``is_greedy`` reads the denoiser: where its sampler starts.
GREEDY_TIME = 1.0

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ScoringSettings:
    """How the bounds are estimated and batched (not what they mean)."""

    samples: int = 16                   # K: time samples per request (diffusion); >= 2 for a standard error
    seed: int = 0
    batch_rows: int | None = None       # rows per forward pass; None: by the device's capacity
    max_batch_rows: int | None = None   # a cap on the capacity's rows

    def __post_init__(self) -> None:
        for name, minimum in (("samples", 1), ("seed", 0), ("batch_rows", 1), ("max_batch_rows", 1)):
            value = getattr(self, name)
            if value is None and name.endswith("rows"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

    def rows(self, model: ScoringModel, seq_len: int) -> int:
        """Rows of ``seq_len`` tokens per forward pass."""
        if self.batch_rows is not None:
            return self.batch_rows
        return min(capacity_rows(model, seq_len), self.max_batch_rows or MAX_BATCH_ROWS)


@dataclass(frozen=True)
class Score:
    """One request's log-likelihood: a lower bound (diffusion) or exact (autoregressive)."""

    log_likelihood: float      # nats: minus the mean of the replicate terms
    standard_error: float      # Monte Carlo, of log_likelihood: 0 when exact, NaN with K = 1
    replicates: np.ndarray     # float64 [K]: the log-likelihood of each replicate ([1] when exact)
    is_greedy: bool = False    # continuations only (an approximation for diffusion models)
    context_dropped: int = 0   # context tokens cut from the left to fit max_seq_len


@dataclass(frozen=True)
class ScoringModel:
    """What is scored: a process (``DiffusionProcess`` or ``Autoregressive``), its network, where."""

    process: Process
    network: DenoiserLike
    max_seq_len: int
    device: torch.device = torch.device("cpu")
    config: TransformerConfig | None = None   # for the capacity estimate; None: CPU_TOKENS_PER_BATCH
    kind: str = "absorbing"                   # model.process, for the capacity estimate
    pad_id: int = 0                           # block diffusion: what fills a row up to whole blocks (EOS)

    @classmethod
    def of(cls, exported: Exported, device: torch.device) -> ScoringModel:
        """An export's process (with a learned schedule's theta) and network, moved to ``device``.
        Its token ids are the tokenizer's own: no value checks (each a host sync). A block
        diffusion's rows are at most ``max_seq_len`` rounded down to whole blocks."""
        network = exported.network.to(device).eval()
        block_size = exported.spec.block_size or 1
        return cls(exported.process(validate=False), network, network.config.max_seq_len // block_size * block_size,
                   device, network.config, exported.spec.process, exported.tokenizer.eos_id)

    @property
    def block_size(self) -> int:
        """The block diffusion's L' (rows are whole blocks); 1 for every other model."""
        return getattr(self.process, "block_size", 1)

    @property
    def exact(self) -> bool:
        return isinstance(self.process, Autoregressive)


# ------------------------------------------------------------------------------ batching
def capacity_rows(model: ScoringModel, seq_len: int) -> int:
    """Rows of ``seq_len`` tokens per forward pass that the device holds (module docstring)."""
    if model.device.type != "cuda" or model.config is None:
        return max(1, CPU_TOKENS_PER_BATCH // seq_len)
    free, _ = torch.cuda.mem_get_info(model.device)
    per_row = activation_memory_bytes(model.config, 1, seq_len, "bf16", checkpointing=True, process=model.kind)
    return int(min(MAX_BATCH_ROWS, max(1, GPU_MEMORY_SHARE * free // per_row)))


def _fitted(call: Callable[[int, Progress], object], rows: int, progress: Progress) -> object:
    """``call(rows, progress)``, halving ``rows`` after each out-of-memory error (the numbers do
    not depend on it); the progress of a failed attempt is taken back."""
    while True:
        done = 0

        def counted(count: int) -> None:
            nonlocal done
            done += count
            progress(count)

        try:
            return call(rows, counted)
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
            progress(-done)
            rows //= 2
            torch.cuda.empty_cache()
            log.warning("out of memory: scoring again with %d rows per forward pass", rows)


@contextmanager
def _scoring_bar(total: int, desc: str) -> Iterator[Progress]:
    with progress_bar(total=total, desc=desc, unit="row") as bar:
        yield bar.update


# ------------------------------------------------------------------------------ continuations
@dataclass(frozen=True)
class _Row:
    tokens: list[int]       # context (cut from the left) + continuation
    scored: int             # the continuation's tokens: the last ``scored`` of ``tokens``
    dropped: int            # context tokens cut


def _fit(context: Sequence[int], continuation: Sequence[int], max_seq_len: int, block_size: int = 1,
         pad_id: int = 0) -> _Row:
    """The row of one request. A block diffusion's row is whole blocks: ``pad_id`` (EOS, a
    document's start) before the context fills it up; never scored, seen as clean context."""
    row = _fit_row(context, continuation, max_seq_len)
    padding = -len(row.tokens) % block_size
    return _Row([pad_id] * padding + row.tokens, row.scored, row.dropped) if padding else row


def _fit_row(context: Sequence[int], continuation: Sequence[int], max_seq_len: int) -> _Row:
    if not continuation:
        raise UserError("a request has an empty continuation: there is nothing to score")
    if len(continuation) > max_seq_len:
        raise UserError(f"a continuation of {len(continuation)} tokens exceeds the model's max_seq_len "
                        f"{max_seq_len}: it cannot be scored in one row")
    keep = max_seq_len - len(continuation)
    kept = list(context)[-keep:] if keep else []
    return _Row(kept + list(continuation), len(continuation), len(context) - len(kept))


def _group_blocks(rows: list[_Row]) -> Blocks:
    """Rows of one length as blocks whose scored positions are the continuations."""
    tokens = torch.tensor([row.tokens for row in rows], dtype=torch.long)
    length = tokens.shape[1]
    scored = torch.tensor([row.scored for row in rows])
    positions = torch.arange(length)[None, :] >= (length - scored)[:, None]
    return Blocks(tokens, positions)


class ContextGuidance(Denoiser):
    """A denoiser guided towards the first ``context`` positions of every row (unsupervised
    classifier-free guidance, LLaDA's loglikelihood): logits cond + w (cond - un), un the same
    call with those positions masked; LLaDA's un + (w + 1)(cond - un) written so that w = 0 is
    the denoiser exactly. ``passes`` counts the forward passes, two per call."""

    def __init__(self, denoiser: DenoiserLike, context: int, weight: float, mask_id: int) -> None:
        self.denoiser, self.context, self.weight, self.mask_id = as_denoiser(denoiser), context, weight, mask_id
        self.passes = 0

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        return self._guided(lambda z: self.denoiser.logits(z, t), z_t)

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        return self._guided(lambda z: self.denoiser.logits_at(z, t, selected), z_t)

    @property
    def time_independent(self) -> bool:
        return self.denoiser.time_independent

    def _guided(self, forward: Callable[[Tensor], Tensor], z: Tensor) -> Tensor:
        cond = forward(z)
        masked = z.clone()
        masked[:, :self.context] = self.mask_id   # [B, L]: the context masked, the continuation as it is
        self.passes += 2
        return cond + self.weight * (cond - forward(masked))


def check_guidance(model: ScoringModel) -> None:
    """A ValueError unless ``model`` can be guided towards a context: a diffusion model with a mask
    (absorbing or learned) that scores a row at once (not block diffusion)."""
    if model.exact or not hasattr(model.process, "mask_id") or model.block_size > 1:
        raise ValueError("guidance masks the context in a second pass, which needs a diffusion export with a mask "
                         "that scores a continuation at once (absorbing or learned; not autoregressive, uniform or "
                         "block diffusion)")


def score_continuations(model: ScoringModel, pairs: Sequence[Pair], settings: ScoringSettings, *,
                        desc: str = "loglikelihood", guidance: float | None = None) -> list[Score]:
    """log p(continuation | context) of every pair, in order; see the module docstring. With
    ``guidance`` w, the guided score (not a bound: module docstring)."""
    if guidance is not None:
        check_guidance(model)
    rows = [_fit(context, continuation, model.max_seq_len, model.block_size, model.pad_id)
            for context, continuation in pairs]
    contexts: dict[tuple[int, ...], int] = {}   # each distinct context's key
    keys = [contexts.setdefault(tuple(context), len(contexts)) for context, _ in pairs]
    groups: dict[tuple[int, int], list[int]] = {}
    for index, row in enumerate(rows):   # guided: one context length per group, the positions un masks
        groups.setdefault((len(row.tokens), 0 if guidance is None else row.scored), []).append(index)
    per_request = 1 if model.exact else settings.samples + 1   # + the greedy pass
    scores: list[Score | None] = [None] * len(rows)
    with _scoring_bar(per_request * len(rows), desc) as progress, torch.no_grad(), \
            inference_mode(model.network, model.device):
        for (length, scored), members in sorted(groups.items()):
            blocks = _group_blocks([rows[i] for i in members])
            draws = _Draws(torch.tensor([keys[i] for i in members]), len(contexts))
            scorer = model if guidance is None else replace(
                model, network=ContextGuidance(model.network, length - scored, guidance, model.process.mask_id))
            group = _score_group(scorer, blocks, settings, draws, progress)
            for index, score in zip(members, group):
                scores[index] = Score(score.log_likelihood, score.standard_error, score.replicates,
                                      score.is_greedy, rows[index].dropped)
    return scores


@dataclass(frozen=True)
class _Draws:
    """Whose random numbers each row of a group takes: its context's key, of ``count``."""

    keys: Tensor
    count: int


def _score_group(model: ScoringModel, blocks: Blocks, settings: ScoringSettings, draws: _Draws,
                 progress: Progress) -> list[Score]:
    rows = settings.rows(model, blocks.tokens.shape[1])
    if model.exact:
        nll, greedy = _fitted(lambda n, done: _causal_scores(model, blocks, n, done), rows, progress)
        return [Score(-value, 0.0, np.array([-value]), flag) for value, flag in zip(nll, greedy)]
    terms = _fitted(lambda n, done: replicate_terms(model.process, model.network, blocks,
                                                    samples_per_block=settings.samples, seed=settings.seed,
                                                    batch_size=n, device=model.device, progress=done,
                                                    keys=draws.keys, num_keys=draws.count), rows, progress)
    greedy = _fitted(lambda n, done: _greedy_flags(model, blocks, n, settings.seed, done), rows, progress)
    return [_from_replicates(-terms[:, j], flag) for j, flag in enumerate(greedy)]


def _from_replicates(log_likelihoods: np.ndarray, is_greedy: bool = False) -> Score:
    count = len(log_likelihoods)
    error = float(log_likelihoods.std(ddof=1)) / math.sqrt(count) if count > 1 else math.nan
    return Score(float(log_likelihoods.mean()), error, log_likelihoods, is_greedy)


def _batches(blocks: Blocks, rows: int, device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    for start in range(0, blocks.num_blocks, rows):
        yield blocks.tokens[start:start + rows].to(device), blocks.positions[start:start + rows].to(device)


def _greedy_flags(model: ScoringModel, blocks: Blocks, rows: int, seed: int, progress: Progress) -> list[bool]:
    """Whether the denoiser's argmax at the sampler's start state (t = 1) is every scored token."""
    process: DiffusionProcess = model.process
    generator = torch.Generator().manual_seed(seed)   # on the host: the flags do not depend on the device
    flags: list[bool] = []
    for x0, scored in _batches(blocks, rows, model.device):
        # a block diffusion's one pass: each block given the clean blocks before it
        block_size = getattr(process, "block_size", None)
        denoiser = as_denoiser(model.network if block_size is None else model.network.given_clean(x0, block_size))
        start = torch.where(scored, process.generate_id, x0)
        prior_tokens = getattr(process, "prior_tokens", None)   # uniform noise, for the uniform process
        if prior_tokens is not None:
            u = torch.rand(start.shape, generator=generator, dtype=torch.float64).to(model.device)
            start = prior_tokens(start, scored, u)
        t = torch.full((x0.shape[0],), GREEDY_TIME, dtype=torch.float64, device=model.device)
        misses = denoiser.logits_at(start, t, scored).argmax(-1) != x0[scored]
        flags += (_row_sums(misses, scored) == 0).tolist()
        progress(x0.shape[0])
    return flags


def _row_sums(values: Tensor, scored: Tensor) -> Tensor:
    """Per row, the sum of ``values`` given at its scored positions (row-major), float64 [B]."""
    return sum_by_row(values, scored.nonzero(as_tuple=True)[0], scored.shape[0])


def _causal_scores(model: ScoringModel, blocks: Blocks, rows: int,
                   progress: Progress) -> tuple[list[float], list[bool]]:
    """Exact -log p of the scored tokens of every row, and whether each is the argmax before it."""
    start_id = model.process.start_id
    denoiser = as_denoiser(model.network)
    nll: list[float] = []
    greedy: list[bool] = []
    for x0, scored in _batches(blocks, rows, model.device):
        inputs = torch.cat([x0.new_full((x0.shape[0], 1), start_id), x0[:, :-1]], dim=1)
        # The causal network's output at position j predicts x0[:, j]: the scored positions are those.
        logits = denoiser.logits_at(inputs, None, scored).float()
        targets = x0[scored]
        losses = F.cross_entropy(logits, targets, reduction="none")
        nll += _row_sums(losses, scored).tolist()
        greedy += (_row_sums(logits.argmax(-1) != targets, scored) == 0).tolist()
        progress(x0.shape[0])
    return nll, greedy


# ------------------------------------------------------------------------------ documents
def score_documents(model: ScoringModel, documents: Sequence[Sequence[int]], settings: ScoringSettings, *,
                    eos_id: int, pad_id: int, desc: str = "loglikelihood_rolling") -> list[Score]:
    """log p(document + EOS) of every document, in order, under our protocol (module docstring)."""
    if not documents:
        return []
    wrapped = [wrap_blocks([list(document)], model.max_seq_len, eos_id=eos_id, pad_id=pad_id) for document in documents]
    blocks = Blocks(torch.cat([w.tokens for w in wrapped]), torch.cat([w.positions for w in wrapped]))
    owner = np.repeat(np.arange(len(wrapped)), [w.num_blocks for w in wrapped])
    rows = settings.rows(model, model.max_seq_len)
    per_block = 1 if model.exact else settings.samples
    with _scoring_bar(per_block * blocks.num_blocks, desc) as progress, torch.no_grad(), \
            inference_mode(model.network, model.device):
        if model.exact:
            nll = _fitted(lambda n, done: _block_nll(model, blocks, n, done), rows, progress)
            totals = -np.bincount(owner, weights=nll, minlength=len(wrapped))
            return [Score(float(total), 0.0, np.array([total])) for total in totals]
        terms = _fitted(lambda n, done: replicate_terms(model.process, model.network, blocks,
                                                        samples_per_block=settings.samples, seed=settings.seed,
                                                        batch_size=n, device=model.device, progress=done),
                        rows, progress)
    # [K, documents]: each replicate's total over a document's blocks.
    per_document = np.stack([np.bincount(owner, weights=row, minlength=len(wrapped)) for row in terms])
    return [_from_replicates(-per_document[:, d]) for d in range(len(wrapped))]


def _block_nll(model: ScoringModel, blocks: Blocks, rows: int, progress: Progress) -> np.ndarray:
    """The exact -log p of every block's real tokens (an autoregressive model), float64 [N]."""
    out = []
    for x0, positions in _batches(blocks, rows, model.device):
        out.append(model.process.nll(model.network, x0, positions).cpu())
        progress(x0.shape[0])
    return torch.cat(out).numpy()

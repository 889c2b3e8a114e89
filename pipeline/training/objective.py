"""The training objective of a micro-batch: the NELBO per sequence (or the AR baseline's NLL).

The loss of an optimizer step is the sum over the global batch of NELBO(x) / (global batch
x L), nats per token (docs/math.md#the-bound), with one (t, z_t) per sequence. What a caller
relies on: the times and masks of a sequence depend only on (seed, step, its place in the
global batch) (``MicroBatchSlot``; the times are low-discrepancy over the global batch,
docs/math.md#low-discrepancy-times), so a step is a pure function of the weights, the global
batch and the seeds, whatever the ranks and micro-batches; every micro-batch makes the same
network calls on every rank (ZeRO-3's gathers need it). An objective is given the trained
module as ``engine_model`` makes it of DeepSpeed's engine: the wrapper stops there. An adapted
run's steps before ``anneal_steps`` call the network with the step's ``AttentionAnnealing``
(``model.annealing``); its validation never does. The manual: docs/training.md#what-a-step-computes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import torch
from torch import Tensor, nn

from model.annealing import AttentionAnnealing, annealing_at
from model.autoregressive import Autoregressive
from model.block_attention import CleanBlocksDenoiser
from model.block_diffusion import BlockDiffusion, block_times
from model.denoiser import Denoiser
from model.generators import seeded_generators
from model.learned import ExponentSpread, exponent_spread
from model.process import DiffusionProcess, low_discrepancy_times
from model.spec import ModelSpec, build_process
from model.trainable import NetworkWithSchedule
from model.transformer import Transformer

__all__ = [
    "FULL_MASK_RATE",
    "AutoregressiveObjective",
    "DiffusionObjective",
    "EngineDenoiser",
    "LearnedScheduleObjective",
    "MicroBatchSlot",
    "Objective",
    "TrainedModel",
    "annealed",
    "engine_model",
    "make_objective",
    "row_generators",
    "schedule_metrics",
    "step_generator",
]


# [beta, omega] of block diffusion's training-only clipping that clips nothing.
FULL_MASK_RATE = (0.0, 1.0)

# The masks' seeds hash (seed, step, MASK_STREAM): a third key keeps them apart from the
# times' generator, seeded by (seed, step).
MASK_STREAM = 1


def step_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` whose seed is a hash of ``keys`` (seed, step, rank, ...)."""
    return seeded_generators(list(keys), device=device)[0]


@dataclass(frozen=True)
class MicroBatchSlot:
    """Where a micro-batch sits in its optimizer step's global batch."""

    seed: int
    step: int
    rank: int
    world_size: int
    micro: int          # index of the micro-batch within this rank's accumulation
    micro_batches: int  # micro-batches per rank per step

    def offset(self, batch: int) -> int:
        return (self.micro * self.world_size + self.rank) * batch

    def global_batch(self, batch: int) -> int:
        return self.micro_batches * self.world_size * batch


# What an objective calls: the network as a ``Denoiser``, or a ``NetworkWithSchedule`` (the learned
# process's trained module, whose forward is the bound); either inside DeepSpeed's engine
# (``engine_model``) or bare.
TrainedModel = Denoiser | nn.Module


class Objective(Protocol):
    def loss_sum(self, model: TrainedModel, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        """Sum over the micro-batch of the per-sequence bound (float64 scalar, differentiable)."""

    def state_metrics(self, module: nn.Module) -> dict[str, float]:
        """Metrics of the process's own parameters in the trained ``module`` ({} for a process
        without any). Every rank calls it: under ZeRO-3 it gathers them."""


class EngineDenoiser(Denoiser):
    """A ``Transformer`` inside DeepSpeed's engine (or the bare network), as a denoiser.

    Every method calls the engine with the arguments the network's own method gives its
    ``forward``, and ``annealing`` when given: the engine's forward is where ZeRO-3 gathers the
    parameters and DeepSpeed's autocast applies, so the network must not be called past it.
    ``time_independent`` is the network's, so samplers through the engine keep their caching.
    """

    def __init__(self, engine: nn.Module, annealing: AttentionAnnealing | None = None) -> None:
        self.engine, self.annealing = engine, annealing
        self.network: Transformer = getattr(engine, "module", engine)  # where DeepSpeed keeps the wrapped network
        self._call = engine if annealing is None else partial(engine, annealing=annealing)

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        return self._call(z_t, t)

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        return self._call(z_t, t, output_mask=selected)

    def nll_at(self, z_t: Tensor, t: Tensor, selected: Tensor, targets: Tensor,
               chunk_rows: int | None = None) -> Tensor:
        return self._call(z_t, t, output_mask=selected, targets=targets, chunk_rows=chunk_rows)

    def given_clean(self, x0: Tensor, block_size: int) -> Denoiser:
        """Block diffusion's forward over [z ; x] through the engine (``Transformer.given_clean``)."""
        return CleanBlocksDenoiser(self._call, x0, block_size)

    @property
    def fused_nll(self) -> bool:
        return self.network.fused_nll

    @property
    def time_independent(self) -> bool:
        return self.network.time_independent


def annealed(denoiser: Denoiser, annealing: AttentionAnnealing) -> Denoiser:
    """``denoiser`` (a network, or one inside DeepSpeed's engine as ``EngineDenoiser``) calling its
    forward with ``annealing``."""
    return EngineDenoiser(denoiser.engine if isinstance(denoiser, EngineDenoiser) else denoiser, annealing)


def engine_model(engine: nn.Module) -> TrainedModel:
    """DeepSpeed's ``engine`` as an objective calls it: the ``NetworkWithSchedule`` it holds through
    the engine's forward (the engine itself), or the network it holds as a ``Denoiser``."""
    return engine if isinstance(engine.module, NetworkWithSchedule) else EngineDenoiser(engine)


def row_generators(device: torch.device, slot: MicroBatchSlot, batch: int) -> list[torch.Generator]:
    """One generator on ``device`` per sequence of the micro-batch, seeded by (seed, step,
    its place in the global batch): the seeds of places 0, 1, ... are the words of one
    SeedSequence of (seed, step, ``MASK_STREAM``): one hash per micro-batch."""
    return seeded_generators([slot.seed, slot.step, MASK_STREAM], batch, first=slot.offset(batch), device=device)


def _times_and_masks(x0: Tensor, slot: MicroBatchSlot) -> tuple[Tensor, list[torch.Generator]]:
    """The micro-batch's slice of the step's global low-discrepancy times (on x0's device),
    and the generators of its masks, one per sequence (module docstring)."""
    batch = x0.shape[0]
    time_gen = step_generator(torch.device("cpu"), slot.seed, slot.step)
    t = low_discrepancy_times(batch, time_gen, offset=slot.offset(batch), global_batch_size=slot.global_batch(batch))
    return t.to(x0.device), row_generators(x0.device, slot, batch)


@dataclass(frozen=True)
class DiffusionObjective:
    """The continuous-time NELBO with both endpoint terms, a strict bound (docs/math.md#the-bound).

    Block diffusion (``BlockDiffusion``) takes one time per block, low-discrepancy over the
    global batch's blocks (``block_times``, the same seeds and slots). With ``mask_rate`` =
    [beta, omega] narrower than [0, 1] each block's masking rate is beta + (omega - beta) u
    for the stratified u, with the weight w(t) at the time that rate is reached: the paper's
    variance reduction for training, not a bound (a trainer validates on the full one). With
    ``anneal_steps``, an adapted run's steps before it see the annealed attention of their
    (seed, step) (``model.annealing``): training only, as the clipping.
    """

    diffusion: DiffusionProcess
    mask_rate: tuple[float, float] = FULL_MASK_RATE
    anneal_steps: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask_rate", tuple(self.mask_rate))

    def clipped(self, mask_rate: tuple[float, float]) -> DiffusionObjective:
        """This objective with block diffusion's masking rates in ``mask_rate``."""
        return replace(self, mask_rate=mask_rate)

    def loss_sum(self, model: Denoiser, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        return self.nelbo(model, x0, slot).sum()

    def nelbo(self, denoiser: Denoiser, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        """The bound of each sequence of the micro-batch [B] (float64) at its slot's times and masks."""
        annealing = annealing_at(slot.step, self.anneal_steps, slot.seed)
        if annealing is not None:
            denoiser = annealed(denoiser, annealing)
        if isinstance(self.diffusion, BlockDiffusion):
            t = self._block_times(x0, slot).to(x0.device)
            masks = row_generators(x0.device, slot, x0.shape[0])
        else:
            t, masks = _times_and_masks(x0, slot)
        return self.diffusion.nelbo(denoiser, x0, t, masks, reconstruction="uniform")

    def _block_times(self, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        batch, blocks = x0.shape[0], self.diffusion.num_blocks(x0.shape[1])
        time_gen = step_generator(torch.device("cpu"), slot.seed, slot.step)
        u = block_times(batch, blocks, time_gen, offset=slot.offset(batch), global_batch_size=slot.global_batch(batch))
        if self.mask_rate == FULL_MASK_RATE:
            return u
        low, high = self.mask_rate
        return self.diffusion.schedule.time_at_masking_rate(low + (high - low) * u)

    def state_metrics(self, module: nn.Module) -> dict[str, float]:
        return {}


class LearnedScheduleObjective:
    """GenMD4's bound, computed by the forward of the trained ``NetworkWithSchedule`` (the network
    and the schedule, whose theta ZeRO-3 gathers for that forward only): the same times and
    masks as ``DiffusionObjective``, K draws of z_t per sequence inside the call."""

    def loss_sum(self, model: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        t, masks = _times_and_masks(x0, slot)
        return model(x0, t, masks).sum()

    def state_metrics(self, module: NetworkWithSchedule) -> dict[str, float]:
        """The spread of the live exponents w_v (below 1/2 the estimator's variance is infinite)."""
        import deepspeed  # imported when needed: evaluation and tests use this module without it

        with torch.no_grad(), deepspeed.zero.GatheredParameters(list(module.schedule.parameters())):
            return schedule_metrics(exponent_spread(module.schedule.exponents(), count=1))


def schedule_metrics(spread: ExponentSpread, prefix: str = "schedule") -> dict[str, float]:
    """``PREFIX/exponent_min``, ``_median`` and ``_max`` of a learned schedule's exponents."""
    return {f"{prefix}/exponent_min": spread.minimum, f"{prefix}/exponent_median": spread.median,
            f"{prefix}/exponent_max": spread.maximum}


class AutoregressiveObjective:
    """Exact next-token NLL of the causal baseline (every token scored)."""

    def __init__(self, autoregressive: Autoregressive) -> None:
        self.autoregressive = autoregressive

    def loss_sum(self, model: Denoiser, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        return self.autoregressive.nll(model, x0).sum()

    def state_metrics(self, module: nn.Module) -> dict[str, float]:
        return {}


def make_objective(spec: ModelSpec, *, validate: bool, chunk_rows: int = 0,
                   block_mask_rate: tuple[float, float] = FULL_MASK_RATE) -> Objective:
    """The objective of ``spec``; ``validate`` checks token ids (a host sync);
    ``chunk_rows`` > 0 computes the absorbing loss's cross-entropy in chunks of that many
    rows (``train.chunked_cross_entropy``; see ``model.cross_entropy``). The learned
    process's objective reads its process from the trained module (``build_trainable``).
    ``block_mask_rate``: block diffusion's training-only clipping (``DiffusionObjective``)."""
    if spec.objective == "diffusion" and spec.process == "learned":
        return LearnedScheduleObjective()
    process = build_process(spec, validate=validate, cross_entropy_chunk_rows=chunk_rows)
    if isinstance(process, Autoregressive):
        return AutoregressiveObjective(process)
    return DiffusionObjective(process, block_mask_rate)


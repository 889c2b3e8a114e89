"""The training objective of a micro-batch: the NELBO per token (or the AR baseline's NLL).

For the diffusion model the loss of an optimizer step is

    loss = sum over the global batch of NELBO(x) / (global batch x L)     (nats per token)

estimated with one (t, z_t) per sequence. The times are low-discrepancy over the GLOBAL
batch: one uniform u per step, shared by every rank (its generator is seeded by
(seed, step)), and micro-batch m of rank r takes the slots ((m * W + r) * b, ...) of the
stratified grid. The masks come from a generator seeded by (seed, step, rank, micro), so
a step is a pure function of the weights, the batch and these seeds: resuming from a
checkpoint repeats it bit for bit. Every micro-batch makes the same network calls on every
rank (``reconstruction="uniform"``), which ZeRO-3's collective gathers require.

The process comes from the model's ``ModelSpec`` (``model_spec``), the one export writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from model.autoregressive import Autoregressive
from model.denoiser import Denoiser
from model.diffusion import DiffusionProcess, low_discrepancy_times
from model.spec import ModelSpec, build_process
from model.transformer import Transformer, TransformerConfig
from pipeline.config import ModelSection

__all__ = ["AutoregressiveObjective", "DiffusionObjective", "EngineDenoiser", "MicroBatchSlot", "Objective",
           "make_objective", "model_spec", "step_generator"]


def step_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` whose seed is a hash of ``keys`` (seed, step, rank, ...)."""
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(seed)


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


class Objective(Protocol):
    def loss_sum(self, network: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        """Sum over the micro-batch of the per-sequence bound (float64 scalar, differentiable).
        ``network``: the network, or DeepSpeed's engine around it."""


class EngineDenoiser(Denoiser):
    """A ``Transformer`` inside DeepSpeed's engine, as a denoiser.

    Every method calls the engine with the arguments the network's own method gives its
    ``forward``: the engine's forward is where ZeRO-3 gathers the parameters and DeepSpeed's
    autocast applies, so the network must not be called past it. ``time_independent`` is
    the network's, so samplers through the engine keep their caching.
    """

    def __init__(self, engine: nn.Module) -> None:
        self.engine = engine
        self.network: Transformer = engine.module  # where DeepSpeed keeps the wrapped network

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        return self.engine(z_t, t)

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        return self.engine(z_t, t, output_mask=selected)

    def nll_at(self, z_t: Tensor, t: Tensor, selected: Tensor, targets: Tensor, chunk_rows: int) -> Tensor:
        return self.engine(z_t, t, output_mask=selected, targets=targets, chunk_rows=chunk_rows)

    @property
    def time_independent(self) -> bool:
        return self.network.time_independent


def _denoiser_of(network: nn.Module) -> Denoiser:
    """The network a trainer hands an objective, as a denoiser: a ``Denoiser`` itself (a
    bare ``Transformer``), or DeepSpeed's engine around one."""
    return network if isinstance(network, Denoiser) else EngineDenoiser(network)


class DiffusionObjective:
    """The continuous-time NELBO with both endpoint terms (a strict bound, see MATH.md)."""

    def __init__(self, diffusion: DiffusionProcess) -> None:
        self.diffusion = diffusion

    def loss_sum(self, network: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        batch = x0.shape[0]
        time_gen = step_generator(torch.device("cpu"), slot.seed, slot.step)
        t = low_discrepancy_times(batch, time_gen, offset=slot.offset(batch),
                                  global_batch_size=slot.global_batch(batch))
        mask_gen = step_generator(x0.device, slot.seed, slot.step, slot.rank, slot.micro)
        return self.diffusion.nelbo(_denoiser_of(network), x0, t.to(x0.device), mask_gen,
                                    reconstruction="uniform").sum()


class AutoregressiveObjective:
    """Exact next-token NLL of the causal baseline (every token scored)."""

    def __init__(self, autoregressive: Autoregressive) -> None:
        self.autoregressive = autoregressive

    def loss_sum(self, network: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        return self.autoregressive.nll(network, x0).sum()


def model_spec(model: ModelSection, network: TransformerConfig) -> ModelSpec:
    """The spec of the model that the config section ``model`` trains on ``network``.
    The config names no process yet: training is the absorbing process or the AR baseline."""
    return ModelSpec(network=network, objective=model.objective, schedule=model.schedule,
                     schedule_args=dict(model.schedule_args))


def make_objective(spec: ModelSpec, *, validate: bool, chunk_rows: int = 0) -> Objective:
    """The objective of ``spec``; ``validate`` checks token ids (a host sync);
    ``chunk_rows`` > 0 computes the diffusion loss's cross-entropy in chunks of that many
    rows (``train.chunked_cross_entropy``; see ``model.cross_entropy``)."""
    process = build_process(spec, validate=validate, cross_entropy_chunk_rows=chunk_rows)
    if isinstance(process, Autoregressive):
        return AutoregressiveObjective(process)
    return DiffusionObjective(process)


NATS_PER_BIT = math.log(2.0)

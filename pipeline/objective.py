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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from model.autoregressive import Autoregressive
from model.diffusion import MaskedDiffusion, low_discrepancy_times
from model.schedules import make_schedule
from pipeline.config import ModelSection

__all__ = ["MicroBatchSlot", "Objective", "DiffusionObjective", "AutoregressiveObjective",
           "make_objective", "step_generator"]


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
        """Sum over the micro-batch of the per-sequence bound (float64 scalar, differentiable)."""


class _Network:
    """The engine seen as a denoiser: DeepSpeed's engine forwards calls to the module but
    not its capabilities (``accepts_output_mask``, ``accepts_targets``)."""

    def __init__(self, network: nn.Module) -> None:
        module = _unwrap(network)
        self.network = network
        self.accepts_output_mask = getattr(module, "accepts_output_mask", False)
        self.accepts_targets = getattr(module, "accepts_targets", False)

    def __call__(self, *args, **kwargs) -> Tensor:
        return self.network(*args, **kwargs)


class DiffusionObjective:
    """The continuous-time NELBO with both endpoint terms (a strict bound, see MATH.md)."""

    def __init__(self, diffusion: MaskedDiffusion) -> None:
        self.diffusion = diffusion

    def loss_sum(self, network: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        batch = x0.shape[0]
        time_gen = step_generator(torch.device("cpu"), slot.seed, slot.step)
        t = low_discrepancy_times(batch, time_gen, offset=slot.offset(batch),
                                  global_batch_size=slot.global_batch(batch))
        mask_gen = step_generator(x0.device, slot.seed, slot.step, slot.rank, slot.micro)
        return self.diffusion.nelbo(_Network(network), x0, t.to(x0.device), mask_gen,
                                    reconstruction="uniform").sum()


class AutoregressiveObjective:
    """Exact next-token NLL of the causal baseline (every token scored)."""

    def __init__(self, autoregressive: Autoregressive) -> None:
        self.autoregressive = autoregressive

    def loss_sum(self, network: nn.Module, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        return self.autoregressive.nll(network, x0).sum()


def _unwrap(network: nn.Module) -> nn.Module:
    return getattr(network, "module", network)


def make_objective(model: ModelSection, vocab_size: int, *, validate: bool, chunk_rows: int = 0) -> Objective:
    """The objective named by the config; ``validate`` checks token ids (a host sync);
    ``chunk_rows`` > 0 computes the diffusion loss's cross-entropy in chunks of that many
    rows (``train.chunked_cross_entropy``; see ``model.cross_entropy``)."""
    if model.objective == "autoregressive":
        return AutoregressiveObjective(Autoregressive(vocab_size, validate=validate))
    schedule = make_schedule(model.schedule, **model.schedule_args)
    return DiffusionObjective(MaskedDiffusion(schedule, vocab_size, validate=validate,
                                              cross_entropy_chunk_rows=chunk_rows))


NATS_PER_BIT = math.log(2.0)

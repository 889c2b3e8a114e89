"""The memory a training step needs on each rank, estimated before the first step.

``estimate_memory`` adds up a ``TrainingPlan``'s model states (``model_state_parts``: weights,
gradients, optimizer states by ZeRO stage and world size, the float32 EMA) and the peak
activations of one micro-batch (``activation_memory_bytes``: micro-batch, sequence length,
activation checkpointing, compiled or eager). ``check_memory`` refuses, in one line with the
numbers, a run whose estimate exceeds the memory a rank has: the GPU's, or on CPU the host's
shared by the ranks of that host. The "auto" settings of ``pipeline.training.engine`` fill only
``USABLE_MEMORY_SHARE`` of it; the refusal takes all of it, so that it never stops a run that
could fit. tests/pipeline/training/test_memory.py holds the estimate against the bytes torch
allocates on CPU. The manual: docs/performance.md#memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.errors import UserError
from common.units import GIB
from model.transformer import TransformerConfig
from pipeline.config import Config
from pipeline.training.engine import TrainingPlan, activation_memory_bytes, device_memory_bytes, model_state_parts

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory", "rank_memory_bytes"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per rank of a training step, part by part."""

    weights: float
    gradients: float
    optimizer: float      # Adam's two moments, and the float32 master weights under bf16
    ema: float
    activations: float    # one micro-batch's forward and backward

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations

    def parts(self) -> str:
        """"weights 1.4 + gradients 2.8 + ... = 57.2 GiB"."""
        named = {"weights": self.weights, "gradients": self.gradients, "optimizer states": self.optimizer,
                 "EMA": self.ema, "activations": self.activations}
        return " + ".join(f"{name} {value / GIB:.1f}" for name, value in named.items()) + f" = {self.total / GIB:.1f} GiB"


def estimate_memory(config: Config, network: TransformerConfig, plan: TrainingPlan) -> MemoryEstimate:
    """The estimate of ``plan`` (as ``plan_training`` resolved it) for ``network`` on sequences
    of ``network.max_seq_len``."""
    states = model_state_parts(plan.parameters, plan.zero_stage, plan.batches.world_size, plan.precision)
    activations = activation_memory_bytes(network, plan.batches.micro_batch, network.max_seq_len, plan.precision,
                                          checkpointing=plan.activation_checkpointing,
                                          chunk_rows=plan.chunked_cross_entropy, process=config.model.process,
                                          compiled=plan.compile)
    return MemoryEstimate(states["weights"], states["gradients"], states["optimizer"], states["ema"], activations)


def rank_memory_bytes(device: torch.device) -> int:
    """The memory one rank has: its GPU's, or on CPU the host's divided among the ranks that
    torchrun started on it (LOCAL_WORLD_SIZE)."""
    memory = device_memory_bytes(device)
    return memory if device.type == "cuda" else memory // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(estimate: MemoryEstimate, plan: TrainingPlan, network: TransformerConfig,
                 memory_bytes: int) -> None:
    """Refuse the run (``UserError``, one line) when ``estimate`` exceeds ``memory_bytes``
    (``rank_memory_bytes``): it would run out of memory at its first step."""
    if estimate.total <= memory_bytes:
        return
    batches = plan.batches
    raise UserError(
        f"this run needs an estimated {estimate.parts()} per rank (micro-batch {batches.micro_batch} x "
        f"{network.max_seq_len} tokens, activation checkpointing {'on' if plan.activation_checkpointing else 'off'}, "
        f"ZeRO-{plan.zero_stage} over {batches.world_size} rank(s), {plan.precision}) and a rank has "
        f"{memory_bytes / GIB:.1f} GiB: lower train.micro_batch_size (auto picks the largest that fits), set "
        f"train.activation_checkpointing true, raise train.zero_stage, or run more ranks")

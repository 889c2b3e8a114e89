"""Learning rate: linear warmup, then constant or cosine decay (a ``LambdaLR``).

The multiplier is a pure function of the optimizer step, so the schedule's state is its
step count, which DeepSpeed checkpoints with the engine. The manual: docs/training.md#configuration.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipeline.config import OptimSection

__all__ = ["lr_multiplier", "make_lr_scheduler"]


def lr_multiplier(step: int, optim: OptimSection, max_steps: int) -> float:
    """Factor on ``optim.lr`` after ``step`` optimizer steps."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.decay == "constant":
        return 1.0
    span = max(max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine


def make_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSection, max_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, optim, max_steps))

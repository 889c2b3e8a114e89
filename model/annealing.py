"""Attention-mask annealing: an adapted autoregressive model's causal attention, opened step by step.

DiffuGPT's recipe (Gong et al., ICLR 2025): at training step s < ``anneal_steps`` each pair of
rows whose key sits after its query (by position) is visible with probability s / anneal_steps,
one draw per step shared by the whole global batch (every micro-batch and rank); from step
``anneal_steps`` on, the target's attention alone (full for MDLM, block diffusion's mask). At
step 0 the attention is the causal one the model was pretrained with, so the adapted network
starts as its source. What a caller relies on: the draw is a function of (seed, step), so a
resumed run anneals as one that never stopped; evaluation and sampling never anneal.
docs/adapting.md#attention-annealing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.block_attention import AttentionLayout

__all__ = ["ANNEAL_STREAM", "AttentionAnnealing", "annealing_at"]

# The annealing draws' seeds hash (seed, step, ANNEAL_STREAM): a key of their own keeps them
# apart from the times' (seed, step) and the masks' (seed, step, 1) (pipeline.training.objective).
ANNEAL_STREAM = 2


@dataclass(frozen=True)
class AttentionAnnealing:
    """One step's annealed attention: a key after its query is visible with probability ``opened``."""

    opened: float   # in [0, 1): the share of the pairs ahead of the query that the step opens
    seed: int       # of the step's one draw

    def __post_init__(self) -> None:
        if not 0.0 <= self.opened < 1.0:
            raise ValueError(f"AttentionAnnealing.opened must lie in [0, 1), got {self.opened!r}")

    def layout(self, base: AttentionLayout | None, rows: int, device: torch.device) -> AttentionLayout:
        """``base`` (None: full attention over ``rows`` rows at positions 0..rows-1; else its
        dense mask and positions) with the pairs ahead of the query kept at this step's draw."""
        if base is not None and (base.cache is not None or not (base.mask is None or isinstance(base.mask, Tensor))):
            raise ValueError("annealing applies to a training forward's dense mask, not to a KV cache or a "
                             "FlexAttention block mask")
        positions = base.positions if base is not None and base.positions is not None else torch.arange(
            rows, device=device)
        behind = positions[None, :] <= positions[:, None]  # [rows, rows]: the key at or before the query
        generator = torch.Generator(device=device).manual_seed(self.seed)
        opened = torch.rand((rows, rows), generator=generator, device=device) < self.opened
        mask = behind | opened
        if base is not None and base.mask is not None:
            mask &= base.mask
        return AttentionLayout(None if base is None else base.positions, mask,
                               outputs=None if base is None else base.outputs)


def annealing_at(step: int, anneal_steps: int, seed: int) -> AttentionAnnealing | None:
    """The annealing of the training step taken from ``step`` (0-based), or None once the
    attention is the target's (``step >= anneal_steps``; ``anneal_steps`` 0: from the start)."""
    if step >= anneal_steps:
        return None
    word = np.random.SeedSequence([seed, step, ANNEAL_STREAM]).generate_state(1, np.uint64)[0]
    return AttentionAnnealing(step / anneal_steps, int(word >> 1))  # 63 bits: inside torch's signed seeds

"""Throughput and model FLOPs utilization (MFU), and the meter of the loop's log intervals.

MFU = tokens/s x FLOPs per token / peak FLOP/s of the device, with the PaLM and nanoGPT
convention for training (``flops_per_token``): 6 N + 12 x layers x d_model x seq_len, N every
parameter of the true vocabulary once; block diffusion's step does more work per token
(``block_diffusion_flops_per_token``). Inference (``forward_flops``) counts the work actually
done: the head only at the rows whose logits are computed. ``IntervalMeter`` sums the loss and
tokens of the steps since the last log on the device (no host sync per step). The manual:
docs/performance.md and docs/mlflow.md#what-a-run-holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from model.transformer import TransformerConfig, parameter_counts
from pipeline.distributed import Distributed

__all__ = [
    "PEAK_BF16_FLOPS",
    "Interval",
    "IntervalMeter",
    "block_diffusion_flops_per_token",
    "flops_per_token",
    "forward_flops",
    "mfu",
    "peak_flops",
]

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' data sheets.
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,   # SXM; the PCIe card is slower but reports the same name prefix
    "H200": 989e12,
}


def flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, of the true vocabulary: the padded rows
    of ``vocab_multiple`` are work the model does not need, so MFU does not credit them."""
    n = parameter_counts(replace(config, vocab_multiple=1)).total
    return 6.0 * n + 12.0 * config.n_layers * config.d_model * seq_len


def block_diffusion_flops_per_token(config: TransformerConfig, seq_len: int, block_size: int) -> float:
    """Training FLOPs per token of block diffusion, counted on the work it does: its forward runs
    2L rows, [z ; x]. The noisy half is credited as MDLM's (``flops_per_token``); the clean half
    runs every matmul but the head's (no logits there); attention, with the block mask's empty
    tiles skipped, gives query b of a noisy block b L' + L' keys and of a clean block (b + 1) L':
    on average L / 2 + L' keys for each of 2L rows, 12 x layers x d_model x (L + 2 L') per token
    (MDLM's full attention: 12 x layers x d_model x L)."""
    unpadded = replace(config, vocab_multiple=1)
    n = parameter_counts(unpadded).total
    head = config.vocab_size * config.d_model
    attention = 12.0 * config.n_layers * config.d_model
    return 6.0 * n + 6.0 * (n - head) + attention * (seq_len + 2 * block_size)


def forward_flops(config: TransformerConfig, seq_len: int, tokens: float, head_rows: float) -> float:
    """Forward FLOPs of ``tokens`` tokens through the blocks in sequences of ``seq_len``, and of
    the head at ``head_rows`` of them (module docstring), with the true vocabulary."""
    true = replace(config, vocab_multiple=1)
    body = 2.0 * parameter_counts(true).non_embedding + 4.0 * config.n_layers * config.d_model * seq_len
    return tokens * body + head_rows * 2.0 * config.d_model * config.vocab_size


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of a known GPU, or None (CPUs and unknown devices: no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def mfu(tokens_per_second: float, flops_per_token_: float, peak: float | None, devices: int) -> float | None:
    """Fraction of the peak of ``devices`` devices achieved, or None without a known peak."""
    if peak is None:
        return None
    return tokens_per_second * flops_per_token_ / (peak * devices)


@dataclass(frozen=True)
class Interval:
    """The steps since the last log, over every rank."""

    loss: float                 # nats per token
    tokens_per_second: float
    step_time: float            # seconds per step


class IntervalMeter:
    """Loss and token sums since the last ``collect``, kept on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.tokens, self.steps, self.start = 0, 0, time.perf_counter()

    def add(self, loss_sum: torch.Tensor, tokens: int) -> None:
        """A micro-batch's summed loss (nats) over ``tokens`` tokens."""
        self.loss += loss_sum
        self.tokens += tokens

    def collect(self, dist: Distributed) -> Interval:
        """The interval since the last collect, summed over all ranks (every rank calls it)."""
        loss, tokens = dist.sum([self.loss.item(), float(self.tokens)])
        seconds = time.perf_counter() - self.start
        steps = max(self.steps, 1)
        self._reset()
        return Interval(loss / tokens, tokens / seconds if seconds > 0 else float("nan"), seconds / steps)

"""Exponential moving average of the weights, kept in float32 next to the live ones.

    ema <- d * ema + (1 - d) * theta,   d = min(decay, (1 + n) / (10 + n)) with warmup

after the n-th update (the warmup keeps early averages from being dominated by the random
initialisation). Under ZeRO-3 each rank averages only the partition of every parameter it
owns (``param.ds_tensor``: a flat, padded slice), so the EMA costs 4 bytes per parameter
divided by the world size; under ZeRO-1/2 every rank averages the whole model.
``state_dict`` is what a checkpoint's rank file holds (``pipeline.run_dir.rank_files``, whose
``whole_ema`` puts the slices back together); ``load_full_state`` takes whole tensors back
into any layout. The manual: docs/training.md#what-a-step-computes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

__all__ = ["EMA", "ema_decay"]

# The warmup of TensorFlow's ExponentialMovingAverage(num_updates): decay (1 + n) / (10 + n).
WARMUP_OFFSET = 10.0


def ema_decay(decay: float, updates: int, warmup: bool) -> float:
    """The decay used for update number ``updates`` (0-based)."""
    return min(decay, (1.0 + updates) / (WARMUP_OFFSET + updates)) if warmup else decay


def _is_partitioned(param: nn.Parameter) -> bool:
    return hasattr(param, "ds_tensor")


def _local(param: nn.Parameter) -> Tensor:
    """The part of ``param`` this rank owns: its ZeRO-3 partition, or all of it."""
    return param.ds_tensor if _is_partitioned(param) else param.data


class EMA:
    """EMA of ``model``'s parameters (by name), for the slice this rank owns."""

    def __init__(self, model: nn.Module, decay: float, *, warmup: bool = True) -> None:
        self.model, self.decay, self.warmup = model, decay, warmup
        self.params = dict(model.named_parameters())
        self.partitioned = any(_is_partitioned(p) for p in self.params.values())
        self.shadow = {name: _local(p).detach().float().clone() for name, p in self.params.items()}
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        d = ema_decay(self.decay, self.updates, self.warmup)
        shadows = list(self.shadow.values())
        current = [_local(p).float() for p in self.params.values()]
        torch._foreach_lerp_(shadows, current, 1.0 - d)
        self.updates += 1

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run the model with the EMA weights inside the block; the live weights return after."""
        backup = {name: _local(p).detach().clone() for name, p in self.params.items()}
        try:
            self._write_all(self.shadow)
            yield
        finally:
            self._write_all(backup)

    def state_dict(self) -> dict:
        shapes = {name: list(p.ds_shape if _is_partitioned(p) else p.shape) for name, p in self.params.items()}
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates,
                "partitioned": self.partitioned, "shapes": shapes,
                "shadow": {name: t.cpu() for name, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow) or state["partitioned"] != self.partitioned:
            raise ValueError("EMA state does not match this model (parameter names or ZeRO-3 layout differ)")
        for name, tensor in state["shadow"].items():
            if tensor.shape != self.shadow[name].shape:
                raise ValueError(f"EMA state for {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(self.shadow[name].shape)}")
            self.shadow[name].copy_(tensor)
        self.updates = state["updates"]

    @torch.no_grad()
    def load_full_state(self, shadow: dict[str, Tensor], updates: int) -> None:
        """Load whole EMA tensors (``whole_ema``'s, of any number of ranks): under ZeRO-3 this
        rank keeps its partition of each, as DeepSpeed cuts it (the flat tensor, zero-padded to
        a multiple of the world size, in equal slices by rank), else all of it."""
        if set(shadow) != set(self.shadow):
            raise ValueError("EMA state does not match this model (parameter names differ)")
        for name, p in self.params.items():
            shape = p.ds_shape if _is_partitioned(p) else p.shape
            if tuple(shadow[name].shape) != tuple(shape):
                raise ValueError(f"EMA state for {name} has shape {tuple(shadow[name].shape)}, expected {tuple(shape)}")
            self.shadow[name].copy_(_partition(shadow[name], self.shadow[name].numel()) if _is_partitioned(p)
                                    else shadow[name])
        self.updates = updates

    @torch.no_grad()
    def _write_all(self, values: dict[str, Tensor]) -> None:
        for name, p in self.params.items():
            _local(p).copy_(values[name])
            # ZeRO-3 keeps small parameters (and recently used ones) gathered between steps;
            # refresh such a full copy from the partitions so the forward sees the new values.
            if _is_partitioned(p) and p.data.numel() == p.ds_numel:
                p.data.copy_(_gather_full(_local(p), p.ds_numel, p.ds_shape))


def _partition(whole: Tensor, size: int) -> Tensor:
    """This rank's ZeRO-3 partition of ``size`` elements of ``whole`` (flat, zero-padded)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    flat = whole.reshape(-1)[rank * size:(rank + 1) * size]
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _gather_full(local: Tensor, numel: int, shape: torch.Size) -> Tensor:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local[:numel].view(shape)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts)[:numel].view(shape)

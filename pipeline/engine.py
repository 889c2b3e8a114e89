"""The DeepSpeed engine: batch arithmetic, ZeRO stage, precision, optimizer, LR schedule.

Everything DeepSpeed needs is derived from the typed config here, so the JSON DeepSpeed
sees is a function of (config, world size, device) and is logged with the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from model.transformer import Block, Transformer
from pipeline.config import Config
from pipeline.distributed import Distributed
from pipeline.errors import UserError
from pipeline.lr_schedule import make_lr_scheduler

__all__ = ["BatchPlan", "plan_batches", "choose_zero_stage", "resolve_precision",
           "deepspeed_config", "build_engine", "device_memory_bytes", "model_state_bytes"]

# Share of device memory that model states (weights, gradients, optimizer) may take when
# choosing a ZeRO stage; the rest is left to activations and the allocator.
MODEL_STATE_MEMORY_SHARE = 0.5
# Bytes per parameter of Adam's state in fp32 (two moments) and of an fp32 master copy.
ADAM_STATE_BYTES = 8
MASTER_WEIGHT_BYTES = 4
# DeepSpeed prints its own step log every N steps; we log ourselves.
DEEPSPEED_PRINT_EVERY = 10**9


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    micro_batch: int
    accumulation: int
    world_size: int


def plan_batches(config: Config, world_size: int) -> BatchPlan:
    """Micro-batch and gradient accumulation from the global batch and the world size."""
    train = config.train
    global_batch, micro = train.global_batch_size, train.micro_batch_size
    if micro is None:
        if global_batch % world_size:
            raise UserError(f"config field train.global_batch_size = {global_batch} does not divide "
                            f"over {world_size} ranks; make it a multiple of {world_size} or set "
                            f"train.micro_batch_size")
        micro = global_batch // world_size
    if global_batch % (micro * world_size):
        raise UserError(f"config fields train.global_batch_size = {global_batch} and train.micro_batch_size "
                        f"= {micro} do not divide over {world_size} ranks: the global batch must be a "
                        f"multiple of micro_batch_size x world size = {micro * world_size}")
    return BatchPlan(global_batch, micro, global_batch // (micro * world_size), world_size)


def resolve_precision(config: Config, device: torch.device) -> str:
    precision = config.train.precision
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_state_bytes(params: int, stage: int, world_size: int, precision: str) -> float:
    """Bytes per rank for weights, gradients and Adam state under a ZeRO stage."""
    weight = 2 if precision == "bf16" else 4
    grad = 4  # gradients accumulate in fp32 (DeepSpeed's grad_accum_dtype)
    optimizer = ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if precision == "bf16" else 0)
    shards = {1: (weight + grad, optimizer), 2: (weight, grad + optimizer), 3: (0, weight + grad + optimizer)}
    whole, sharded = shards[stage]
    return params * (whole + sharded / world_size)


def choose_zero_stage(params: int, world_size: int, precision: str, memory_bytes: int) -> int:
    """The lowest ZeRO stage whose model states fit: lower stages communicate less
    (stage 1 all-reduces gradients once per step; 2 adds reduce-scatters during the
    backward; 3 gathers every weight twice per step), so the lowest that fits is fastest
    (BENCHMARKS.md measures the order)."""
    for stage in (1, 2, 3):
        if model_state_bytes(params, stage, world_size, precision) <= MODEL_STATE_MEMORY_SHARE * memory_bytes:
            return stage
    return 3


def deepspeed_config(config: Config, plan: BatchPlan, zero_stage: int, precision: str) -> dict[str, Any]:
    """The DeepSpeed JSON for this run."""
    ds: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        # Our AdamW (torch's, fused on GPU) is the client optimizer under every ZeRO stage.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": DEEPSPEED_PRINT_EVERY,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and the embedding); never norms or biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_engine(model: Transformer, config: Config, dist: Distributed, plan: BatchPlan,
                 zero_stage: int, precision: str):
    """``deepspeed.initialize`` with our optimizer and LR schedule; returns the engine."""
    import deepspeed

    if config.train.activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    optim = config.optim
    optimizer = torch.optim.AdamW(_param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas,
                                  eps=optim.eps, fused=dist.device.type == "cuda")
    scheduler = make_lr_scheduler(optimizer, optim, config.train.max_steps)
    if zero_stage == 3 and model.head is None:
        # The tied head reads the embedding's weight outside the embedding module's
        # forward; ZeRO-3 must gather it there too.
        deepspeed.zero.register_external_parameter(model, model.embed.weight)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(config, plan, zero_stage, precision))
    return engine

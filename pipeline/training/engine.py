"""The DeepSpeed engine: batch arithmetic, ZeRO stage, precision, optimizer, LR schedule.

Everything DeepSpeed needs is derived from the typed config here, so the JSON DeepSpeed sees
is a function of (config, world size, device) and is logged with the run. Every "auto" of
``train`` is decided here, once, into a ``TrainingPlan``: the ZeRO stage from the model
states' memory, the micro-batch (and activation checkpointing) from the activations' memory
estimate, compile from the device, and the attention kernel by asking SDPA
(``pipeline.training.attention``). The manual: docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from common.errors import UserError
from model.learned import DEFAULT_DRAWS
from model.trainable import NetworkWithSchedule
from model.transformer import Block, Transformer, TransformerConfig, parameter_counts
from pipeline.config import Config, OptimSection
from pipeline.training.attention import resolve_attention, resolve_block_attention
from pipeline.training.float8 import convert_to_float8, resolve_float8
from pipeline.training.lr_schedule import make_lr_scheduler

__all__ = ["BatchPlan", "TrainingPlan", "plan_training", "plan_batches", "choose_zero_stage", "resolve_precision",
           "deepspeed_config", "build_engine", "build_optimizer", "device_memory_bytes", "model_state_bytes",
           "activation_memory_bytes", "resolve_activation_checkpointing", "prepare_model", "network_of",
           "choose_micro_batch", "resolve_compile", "ACTIVATION_DTYPES", "inference_memory_bytes",
           "choose_inference_batch", "model_state_parts"]

# Share of device memory that model states (weights, gradients, optimizer, EMA) may take when
# choosing a ZeRO stage; the rest is left to activations and the allocator.
MODEL_STATE_MEMORY_SHARE = 0.5
# Bytes per parameter of Adam's state in fp32 (two moments) and of an fp32 master copy.
ADAM_STATE_BYTES = 8
MASTER_WEIGHT_BYTES = 4
# DeepSpeed prints its own step log every N steps; we log ourselves.
DEEPSPEED_PRINT_EVERY = 10**9
# Share of device memory that model states and activations may fill together before "auto"
# activation checkpointing turns on; DeepSpeed's communication buckets, the CUDA context,
# the allocator's fragmentation and transient buffers take the rest.
USABLE_MEMORY_SHARE = 0.8
# Activations a block keeps for its backward, per token, in units of d_model (our block,
# counted from its ops): the float32 inputs of its two LayerNorms, and at the activation
# dtype the inputs of qkv (1), SDPA's q, k, v and output (4; flash attention stores no
# L x L scores), the output projection's input (1), the MLP's up input (1), GELU's input
# (4) and down's input (4). Dropout masks and adaLN modulation add a little more.
BLOCK_FLOAT32_WIDTHS = 2
BLOCK_ACTIVATION_WIDTHS = 15
# Eager blocks (train.compile off) keep 2 more: v is a view of qkv's output, which so stays
# alive whole beside the rotated q and k (measured on CPU, tests/pipeline/training/test_memory.py).
EAGER_BLOCK_WIDTHS = 2
# A block's backward holds, beside its saved tensors, gradients about as wide as the MLP's
# hidden layer (4 d_model, at the activation dtype): the peak of a recomputed block.
BLOCK_BACKWARD_WIDTHS = 4
# Bytes per logit of the loss besides the logits themselves: the float32 log-softmax that
# autograd keeps and the float32 copy it is computed from.
LOGIT_FLOAT32_BYTES = 8
# Bytes per logit of the eager loss, logits included, under fp32 and bf16 alike (measured on
# CPU): the logits, their float32 log-softmax and a gradient of the logits' size, beside the
# float32 copy under bf16 (under fp32 the copy is the logits themselves).
EAGER_LOGIT_BYTES = 12
# The same for the uniform and learned processes, whose bounds use the whole prediction mu
# (not only -log mu at the target): they keep about four float32 [N, V] tensors for the
# backward (16 bytes per logit, counted with torch.autograd.graph.saved_tensors_hooks),
# beside the float32 copy of the logits.
FULL_PREDICTION_FLOAT32_BYTES = 20
FLOAT32_BYTES = 4
# The float32 EMA of the weights (pipeline.training.ema), per parameter: kept whole on every
# rank, partitioned under ZeRO-3.
EMA_BYTES = 4
# The dtype of the activations (and so of the attention inputs) under each precision.
ACTIVATION_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# DeepSpeed's gradient buckets under ZeRO 1 and 2, in elements, for one to eight GPUs of a
# node. Its default (5e8) holds all of GPT-2 medium's 355M gradients: the reduction would
# then start only once the backward is over. 5e7 splits medium into about seven buckets, so
# that with overlap_comm each bucket is reduced while the backward computes the next, and a
# bucket of 5e7 fp32 values (200 MB) is still far above the few MB at which NCCL reaches its
# bus bandwidth over NVLink. The all-gather of the updated weights (stage 1 and 2) takes
# buckets of the same size. overlap_comm keeps about 4.5 buckets of buffers (0.9 GB): worth
# it only with someone to talk to, so a single rank leaves it off; contiguous_gradients
# copies each gradient into one preallocated buffer as it is produced (no fragmentation at
# the step, stage 2's reduce-scatter reads it in place).
GRADIENT_BUCKET_ELEMENTS = 50_000_000


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    micro_batch: int
    accumulation: int
    world_size: int


@dataclass(frozen=True)
class TrainingPlan:
    """What a run's config resolves to on this job and device, every "auto" decided: the one
    value the engine, the checkpoint's metadata and the tracking params are built from."""

    batches: BatchPlan
    zero_stage: int
    precision: str                   # "fp32" | "bf16"
    activation_checkpointing: bool
    compile: bool
    attention: str                   # a pipeline.training.attention.KERNELS key
    chunked_cross_entropy: int       # rows per chunk of the head and loss; 0: all at once
    parameters: int                  # of the whole network (before ZeRO-3 partitions it)
    overlap_comm: bool = False       # DeepSpeed reduces gradient buckets during the backward
    block_attention: str = "dense"   # block diffusion's or document masking's mask: "flex" or "dense" (else unused)
    float8: bool = False             # the blocks' projections in FP8 (pipeline.training.float8)


def plan_training(config: Config, network: TransformerConfig, world_size: int, device: torch.device) -> TrainingPlan:
    """Resolve ``config.train`` for ``network`` on ``world_size`` ranks of ``device``."""
    precision = resolve_precision(config, device)
    parameters = parameter_counts(network).total
    memory = device_memory_bytes(device)
    stage = config.train.zero_stage
    zero_stage = choose_zero_stage(parameters, world_size, precision, memory) if stage == "auto" else stage
    compiled = resolve_compile(config.train.compile, device, zero_stage)
    float8 = resolve_float8(config.train.float8, device, compiled)
    if config.train.micro_batch_size == "auto" and device.type == "cuda":
        micro, checkpointing = choose_micro_batch(config, network, world_size, zero_stage, precision, memory,
                                                  compiled=compiled)
        batches = plan_batches(config, world_size, micro)
    else:
        batches = plan_batches(config, world_size)
        checkpointing = resolve_activation_checkpointing(config, network, batches, zero_stage, precision, memory,
                                                         compiled=compiled)
    masks = config.model.block_size is not None or network.document_separator is not None
    block_attention = (resolve_block_attention(config.train.block_attention, device, network.dropout) if masks
                       else "dense")
    # A boolean mask reaches SDPA with block diffusion's or document masking's dense mask, and in an
    # adapted run's annealed steps (model.annealing): the kernel must take one (flash on GPU does not).
    masked = (masks and block_attention == "dense") or config.adapt.anneal_steps > 0
    attention = resolve_attention(config.train.attention, device, ACTIVATION_DTYPES[precision], network.head_dim,
                                  causal=network.causal, dropout=network.dropout, masked=masked)
    return TrainingPlan(batches, zero_stage, precision, checkpointing, compiled, attention,
                        config.train.chunked_cross_entropy, parameters,
                        overlap_comm=device.type == "cuda" and world_size > 1, block_attention=block_attention,
                        float8=float8)


def resolve_compile(setting: bool | str, device: torch.device, zero_stage: int) -> bool:
    """``train.compile`` as a decision. "auto": on for CUDA, where fused kernels and fewer
    launches pay for the first steps' compilation, unless ZeRO-3 (it gathers each block's
    weights in hooks around the block's forward, which compiling the block would trace);
    off for CPU, where inductor's C++ compile takes longer than a short run saves."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cuda" and zero_stage < 3


def _per_rank_batch(config: Config, world_size: int) -> int:
    """The global batch over ``world_size`` ranks: sequences per rank per step."""
    global_batch = config.train.global_batch_size
    if global_batch % world_size:
        raise UserError(_indivisible(global_batch, world_size))
    return global_batch // world_size


def _indivisible(global_batch: int, world_size: int) -> str:
    """The refusal of a global batch that no micro-batch size spreads over ``world_size`` ranks."""
    below = global_batch // world_size * world_size
    multiples = " or ".join(str(m) for m in (below, below + world_size) if m > 0)
    return (f"config field train.global_batch_size = {global_batch} does not divide over {world_size} ranks, "
            f"whatever train.micro_batch_size is: make it a multiple of {world_size} ({multiples}), or run "
            f"{_near_divisors(global_batch, world_size)} processes")


def _near_divisors(number: int, around: int) -> str:
    """The divisors of ``number`` nearest ``around``, below and above it: "a or b"."""
    divisors = [d for d in range(1, number + 1) if number % d == 0 and d != around]
    below = [d for d in divisors if d < around][-1:]
    above = [d for d in divisors if d > around][:1]
    return " or ".join(map(str, below + above))


def choose_micro_batch(config: Config, network: TransformerConfig, world_size: int, zero_stage: int,
                       precision: str, memory_bytes: int, *, compiled: bool = True) -> tuple[int, bool]:
    """``train.micro_batch_size: auto`` on a GPU: the largest micro-batch that divides the
    rank's share of the global batch and whose activations (``activation_memory_bytes``,
    sequences of ``max_seq_len``) fit next to the model states in ``USABLE_MEMORY_SHARE`` of
    ``memory_bytes``; and whether it needs activation checkpointing. With
    ``activation_checkpointing: auto`` a micro-batch without it is preferred (recomputation
    costs a third more compute); only when not even one sequence fits is it turned on. When
    nothing fits, 1 (``pipeline.training.memory.check_memory`` then refuses the run).
    ``compiled``: the blocks and loss run compiled (``train.compile``), keeping less."""
    per_rank = _per_rank_batch(config, world_size)
    states = model_state_bytes(parameter_counts(network).total, zero_stage, world_size, precision)
    budget = USABLE_MEMORY_SHARE * memory_bytes - states
    setting = config.train.activation_checkpointing
    choices = [setting] if isinstance(setting, bool) else [False, True]
    for checkpointing in choices:
        for micro in (m for m in range(per_rank, 0, -1) if per_rank % m == 0):
            needed = activation_memory_bytes(network, micro, network.max_seq_len, precision,
                                             checkpointing=checkpointing, chunk_rows=config.train.chunked_cross_entropy,
                                             process=config.model.process, compiled=compiled)
            if needed <= budget:
                return micro, checkpointing
    return 1, choices[-1]


def plan_batches(config: Config, world_size: int, micro_batch: int | None = None) -> BatchPlan:
    """Micro-batch and gradient accumulation from the global batch and the world size;
    ``micro_batch`` (e.g. ``choose_micro_batch``'s) replaces ``train.micro_batch_size``,
    whose None and "auto" (off GPU) mean global / world size."""
    global_batch, per_rank = config.train.global_batch_size, _per_rank_batch(config, world_size)
    micro = micro_batch or config.train.micro_batch_size
    if not isinstance(micro, int):
        micro = per_rank
    if per_rank % micro:
        raise UserError(f"config fields train.global_batch_size = {global_batch} and train.micro_batch_size "
                        f"= {micro} do not divide over {world_size} ranks: each rank takes {per_rank} sequences "
                        f"a step, in micro-batches; choose a train.micro_batch_size that divides {per_rank} "
                        f"({_near_divisors(per_rank, micro)}), or auto")
    return BatchPlan(global_batch, micro, per_rank // micro, world_size)


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


def model_state_parts(params: int, stage: int, world_size: int, precision: str) -> dict[str, float]:
    """Bytes per rank of the weights, gradients, optimizer states (Adam's moments and, under
    bf16, the fp32 master weights) and the EMA under a ZeRO stage: stage 1 partitions the
    optimizer states over the ranks, 2 the gradients too, 3 everything."""
    per_param = {"weights": 2 if precision == "bf16" else 4,
                 "gradients": 4,  # gradients accumulate in fp32 (DeepSpeed's grad_accum_dtype)
                 "optimizer": ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if precision == "bf16" else 0),
                 "ema": EMA_BYTES}
    sharded = {1: {"optimizer"}, 2: {"optimizer", "gradients"}, 3: set(per_param)}[stage]
    return {part: params * size / (world_size if part in sharded else 1) for part, size in per_param.items()}


def model_state_bytes(params: int, stage: int, world_size: int, precision: str) -> float:
    """Bytes per rank of the weights, gradients, optimizer states and EMA (``model_state_parts``)."""
    return sum(model_state_parts(params, stage, world_size, precision).values())


def choose_zero_stage(params: int, world_size: int, precision: str, memory_bytes: int) -> int:
    """The lowest ZeRO stage whose model states fit: lower stages communicate less
    (stage 1 all-reduces gradients once per step; 2 adds reduce-scatters during the
    backward; 3 gathers every weight twice per step), so the lowest that fits is fastest
    (BENCHMARKS.md measures the order)."""
    for stage in (1, 2, 3):
        if model_state_bytes(params, stage, world_size, precision) <= MODEL_STATE_MEMORY_SHARE * memory_bytes:
            return stage
    return 3


def activation_memory_bytes(network: TransformerConfig, micro_batch: int, seq_len: int, precision: str, *,
                            checkpointing: bool = False, chunk_rows: int = 0, process: str = "absorbing",
                            compiled: bool = True) -> float:
    """Estimated peak bytes of the activations of one micro-batch's forward and backward.

    Blocks: each keeps ``BLOCK_FLOAT32_WIDTHS`` float32 and ``BLOCK_ACTIVATION_WIDTHS``
    activation-dtype (2 bytes under bf16, 4 under fp32) values per token per unit of
    d_model (``EAGER_BLOCK_WIDTHS`` more unless ``compiled``). Loss: the final norm and head
    inputs of every token, plus for each row of logits alive at once V logits at the
    activation dtype and ``LOGIT_FLOAT32_BYTES`` per logit (eager: ``EAGER_LOGIT_BYTES`` in
    all). The peak is at the start of the backward, every block's activations and the loss's
    alive. With ``checkpointing`` a block keeps only its input, and the backward recomputes
    one block at a time once the loss's tensors are freed: the peak is the larger of the
    two, a recomputed block's with ``BLOCK_BACKWARD_WIDTHS`` of gradients. Every position counts as masked: a micro-batch takes one contiguous slice of the
    global batch's stratified times, so all of its times may lie near t = 1. ``chunk_rows``
    (``train.chunked_cross_entropy``) bounds the rows alive at once. ``process``
    (``model.process``): the uniform and learned bounds keep ``FULL_PREDICTION_FLOAT32_BYTES``
    per logit instead (the uniform one scores every position), and the learned one passes
    ``DEFAULT_DRAWS`` copies of each sequence through the network. Assumes flash or
    memory-efficient attention (SDPA's kernels on GPU and CPU): the math kernel also stores
    the L x L scores. tests/pipeline/training/test_memory.py measures it on CPU.
    """
    width = 2 if precision == "bf16" else FLOAT32_BYTES
    tokens = micro_batch * seq_len * (DEFAULT_DRAWS if process == "learned" else 1)
    if process != "absorbing":
        logit_bytes = FULL_PREDICTION_FLOAT32_BYTES + width
    else:
        logit_bytes = LOGIT_FLOAT32_BYTES + width if compiled else EAGER_LOGIT_BYTES
    widths = BLOCK_ACTIVATION_WIDTHS + (0 if compiled else EAGER_BLOCK_WIDTHS)
    per_block = tokens * network.d_model * (BLOCK_FLOAT32_WIDTHS * FLOAT32_BYTES + widths * width)
    rows = min(chunk_rows, tokens) if chunk_rows else tokens
    head_inputs = tokens * network.d_model * (FLOAT32_BYTES + width)
    logits = rows * network.logit_columns * logit_bytes
    if checkpointing:
        recomputed = per_block + tokens * network.d_model * BLOCK_BACKWARD_WIDTHS * width
        return float(network.n_layers * tokens * network.d_model * width + head_inputs + max(recomputed, logits))
    return float(network.n_layers * per_block + head_inputs + logits)


def inference_memory_bytes(network: TransformerConfig, batch: int, seq_len: int, precision: str) -> float:
    """Estimated peak bytes of a no-grad forward of ``batch`` sequences with the loss at every
    position (evaluation's worst case: every token masked): the float32 weights and, under
    bf16 autocast, their bf16 copies; one block's activations at a time (without autograd
    nothing is kept from one block to the next; a training block's saved set bounds what one
    block holds); the float32 residual stream; and the head's logits as in training."""
    width = 2 if precision == "bf16" else FLOAT32_BYTES
    weights = parameter_counts(network).total * (FLOAT32_BYTES + (width if precision == "bf16" else 0))
    tokens = batch * seq_len
    block = tokens * network.d_model * (BLOCK_FLOAT32_WIDTHS * FLOAT32_BYTES + BLOCK_ACTIVATION_WIDTHS * width)
    residual = tokens * network.d_model * FLOAT32_BYTES
    logits = tokens * network.logit_columns * (LOGIT_FLOAT32_BYTES + width)
    return float(weights + block + residual + logits)


def choose_inference_batch(network: TransformerConfig, seq_len: int, precision: str, memory_bytes: int,
                           largest: int) -> int:
    """The largest power of two up to ``largest`` whose no-grad forward
    (``inference_memory_bytes``) fits in ``USABLE_MEMORY_SHARE`` of ``memory_bytes``; 1 if none does."""
    batch = 1 << (largest.bit_length() - 1)
    while batch > 1 and inference_memory_bytes(network, batch, seq_len, precision) > USABLE_MEMORY_SHARE * memory_bytes:
        batch //= 2
    return batch


def resolve_activation_checkpointing(config: Config, network: TransformerConfig, plan: BatchPlan, zero_stage: int,
                                     precision: str, memory_bytes: int, *, compiled: bool = True) -> bool:
    """``train.activation_checkpointing`` as a decision: true and false as given; "auto" is
    on only when the model states (``model_state_bytes``) and the micro-batch's activations
    without checkpointing (``activation_memory_bytes``, sequences of ``max_seq_len``) exceed
    ``USABLE_MEMORY_SHARE`` of ``memory_bytes``: recomputation costs about a third more
    compute, so it is worth it only when the alternative does not fit."""
    setting = config.train.activation_checkpointing
    if setting != "auto":
        return setting
    states = model_state_bytes(parameter_counts(network).total, zero_stage, plan.world_size, precision)
    activations = activation_memory_bytes(network, plan.micro_batch, network.max_seq_len, precision,
                                          chunk_rows=config.train.chunked_cross_entropy,
                                          process=config.model.process, compiled=compiled)
    return states + activations > USABLE_MEMORY_SHARE * memory_bytes


def network_of(model: nn.Module) -> Transformer:
    """The network of a trained module (``model.spec.build_trainable``): itself, or a
    ``NetworkWithSchedule``'s."""
    return model.network if isinstance(model, NetworkWithSchedule) else model


def prepare_model(model: nn.Module, *, checkpointing: bool, compile: bool, float8: bool = False,
                  **compile_options: Any) -> None:
    """Apply the network-side optimizations in place, before an engine wraps the model
    (a network, or a ``NetworkWithSchedule`` holding one).

    ``float8`` first swaps the blocks' projections for FP8 ones (``convert_to_float8``), which
    compilation then fuses. ``checkpointing`` wraps each block in activation checkpointing. ``compile``
    (``train.compile``) compiles each (wrapped) block and the head with its loss
    (``Transformer.compile_parts``, ``compile_options`` passed to ``torch.compile``), as
    torchtitan compiles per block, rather than the whole forward: the forward selects the
    masked positions (a data-dependent size that would break the graph there), the
    identical blocks share one compiled graph, and compiling in place keeps parameter
    names, so checkpoints, EMA and export are unchanged.
    """
    if float8:
        convert_to_float8(network_of(model))
    if checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    if compile:
        network_of(model).compile_parts(**compile_options)


def deepspeed_config(plan: TrainingPlan, optim: OptimSection) -> dict[str, Any]:
    """The DeepSpeed JSON for this run."""
    batches, precision = plan.batches, plan.precision
    ds: dict[str, Any] = {
        "train_batch_size": batches.global_batch,
        "train_micro_batch_size_per_gpu": batches.micro_batch,
        "gradient_accumulation_steps": batches.accumulation,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": _zero_optimization(plan),
        "bf16": {"enabled": precision == "bf16"},
        # Our AdamW (torch's, fused on GPU) is the client optimizer under every ZeRO stage.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": DEEPSPEED_PRINT_EVERY,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def _zero_optimization(plan: TrainingPlan) -> dict[str, Any]:
    """The ZeRO section: the stage, and under stages 1 and 2 the buckets and overlap of
    ``GRADIENT_BUCKET_ELEMENTS`` (stage 3 keeps DeepSpeed's own prefetch and bucket sizes)."""
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage in (1, 2):
        zero.update(reduce_bucket_size=GRADIENT_BUCKET_ELEMENTS, allgather_bucket_size=GRADIENT_BUCKET_ELEMENTS,
                    overlap_comm=plan.overlap_comm, contiguous_gradients=True)
    return zero


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and the embedding); never norms, biases or GenMD4's schedule (theta [V])."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim: OptimSection, device: torch.device, *,
                    fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters as configured, weight decay on matrices only;
    ``fused`` (one kernel for all parameters) defaults to on for GPU."""
    fused = device.type == "cuda" if fused is None else fused
    return torch.optim.AdamW(_param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas,
                             eps=optim.eps, fused=fused)


def build_engine(model: nn.Module, plan: TrainingPlan, optim: OptimSection, max_steps: int,
                 device: torch.device):
    """``deepspeed.initialize`` with our optimizer and LR schedule (``max_steps`` long), after
    ``prepare_model`` (activation checkpointing and torch.compile as the plan decided), for
    the trained module (``model.spec.build_trainable``); returns the engine."""
    import deepspeed

    prepare_model(model, checkpointing=plan.activation_checkpointing, compile=plan.compile, float8=plan.float8)
    optimizer = build_optimizer(model, optim, device)
    scheduler = make_lr_scheduler(optimizer, optim, max_steps)
    if plan.zero_stage == 3:
        for owner, parameter in _external_parameters(model):
            deepspeed.zero.register_external_parameter(owner, parameter)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(plan, optim))
    return engine


def _external_parameters(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(module, parameter) pairs where the module's forward reads a parameter it does not own:
    ZeRO-3 gathers a module's own parameters for its forward, and these too once registered.
    The tied head reads the embedding's weight in the network's forward; GenMD4's bound reads
    the schedule's theta in the ``NetworkWithSchedule``'s."""
    network = network_of(model)
    pairs = [(network, network.embed.weight)] if network.head is None else []
    if isinstance(model, NetworkWithSchedule):
        pairs += [(model, parameter) for parameter in model.schedule.parameters()]
    return pairs

"""GPU training, evaluation and sampling throughput, one optimization at a time.

Training. For every (preset, micro-batch, variant) it builds a fresh model, runs --warmup
steps (compilation, allocator, optimizer state), then times --steps steps between two
device synchronizations and prints one JSON line: mean step time, tokens/s, MFU (tokens/s x
pipeline.training.throughput.flops_per_token over the device's bf16 peak, PEAK_BF16_FLOPS, FP8 rows
included), peak memory (torch.cuda.max_memory_allocated from the model's creation on; CUDA
only) beside the memory estimate (pipeline.training.memory.estimate_memory) and the share of
the timed wall time the host spent blocked on the data loader (an upper bound on the GPU's
stall, which may still run queued work meanwhile). A variant that runs out of memory gets
an ``error`` instead. Variants, named BASE[+OPTION...]:

  pipeline-zero1, pipeline-zero2   the training pipeline's parts: pipeline.training.engine.build_engine
                                   (DeepSpeed ZeRO-1 or 2; bf16 weights with fp32 master copies
                                   on GPU), the training objective and EMA, fed by the real
                                   StreamingLoader over shards of the real prep
  torch                            no DeepSpeed: the same model and objective in float32 under
                                   bf16 autocast (GPU), fused AdamW, gradient clipping; random
                                   token batches made on the device
  Every base runs the config's defaults (what `unmask train` does with no flags: train.compile
  auto, on for CUDA; train.attention auto; model.vocab_multiple 128) unless an option says:
  +compile, +eager                 train.compile true / false: blocks and the head with its loss
  +unpadded                        model.vocab_multiple = 1 (the head's 50257 rows as they are)
  +cudnn, +flash, +efficient,      train.attention = that SDPA kernel
  +math-attention
  +chunked-ce                      train.chunked_cross_entropy = --chunk-rows
  +checkpointing                   train.activation_checkpointing = true
  +fp8                             train.float8 = true: the blocks' projections in FP8 (torchao,
                                   compiled; a GPU of compute capability >= 8.9, else an error row)
  +full-logits                     (torch only) logits at every position, then the masked rows
                                   picked: what computing them at masked positions only saves
  +foreach-adamw                   (torch only) AdamW's multi-tensor path instead of the fused kernel
  +no-pin                          (pipeline only) the loader without pinned-memory prefetch
  +sync                            a .item() of the loss every step (a host-device sync, as a
                                   naive loop logs); the pipeline syncs only every logging.every steps
  +bd3-4, +bd3-8, +bd3-16          block diffusion (model.block_size = 4, 8, 16): the forward over
                                   [z ; x] under FlexAttention's block mask; the same tokens per step,
                                   MFU on the work it does (pipeline.training.throughput.block_diffusion_flops_per_token):
                                   compare its step time with the same variant without it
  +adapt-gpt2                      the preset's network adapted from a GPT-2 of its shape (bench/gpt2_source.py:
                                   random weights saved with transformers, GPT-2's layers, the shift), read
                                   and adapted as `unmask train --init-from DIR` does (docs/adapting.md),
                                   after its annealing (full attention): compare its MFU with the same
                                   variant without it (the issue's target: within 10%)
  +annealed                        (with +adapt-gpt2) every timed step inside the annealing (adapt.anneal_steps
                                   past the run): the dense boolean mask of model.annealing and a kernel
                                   that takes it
  pipeline-zero1+eager+unpadded+flash is the pipeline as it ran before these defaults.

Every variant trains with one micro-batch per optimizer step. Evaluation: per preset,
bench/eval_throughput.py's measure (estimate_bound, tokens/s per time sample, next to a
plain forward), as it ran before (eager, --eval-batch) and as `unmask eval` runs now
(compiled, its batch sized to the device), with its FLOP utilization: the forward FLOPs of
the tokens actually passed (pipeline.training.throughput.forward_flops: blocks for every token, the head
at the masked rows) per second over the peak, and in the 2N + 4·L·d·T convention. Sampling:
per preset, --sample-batch (64) sequences from all-mask as `unmask sample` runs them, by
cached ancestral and by first-hitting with a budget of --sample-steps calls (1000; the GPU
check passes 32: the utilization of a call does not depend on how many there are), eager and,
on a GPU, with the blocks compiled: sequences/s, tokens/s, seconds per call, utilization; then
eager, fast generation's rows at the same budget (semi-autoregressive blocks without and with
the prefix cache, whole-sequence blocks without and with the dual cache) and the autoregressive
network of the same shape with its KV cache. At 64 x 1024
tokens a call is ~0.1 s of GPU work, so launch overhead (what CUDA graphs would save) is
small; the host's per-call reads are the syncs the samplers' docstrings name. lm-eval:
--lm-eval-requests loglikelihood requests scored as `unmask lm-eval` does, requests/s.

Data: --data, an `unmask prep` output; without it the bench preps --inputs (default
tinyshakespeare and PTB train, bench/prep_and_load.py's SOURCES) with --tokenizer (default
GPT-2 BPE from ../shared/data) at --seq-len. Vocabulary and sequence length of every variant
come from the shards. One process, one device (several GPUs: bench/train_zero_stages.py).
DeepSpeed prints some lines of its own to stdout: the bench's are those starting with "{".

    python bench/train_gpu.py --presets small medium --micro-batches 4 8 16
    python bench/train_gpu.py --presets large xl --micro-batches 8 --variants pipeline-zero1 --skip-inference
    python bench/train_gpu.py --presets medium xl --micro-batches 8 --variants pipeline-zero1 pipeline-zero1+fp8 \
        --skip-inference                                          # MFU with and without FP8
    python bench/train_gpu.py --device cpu --presets tiny --steps 3    # smoke test, minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Siblings in bench/ (the script's own directory is on sys.path).
from eval_throughput import measure as measure_evaluation
from eval_throughput import synchronize  # noqa: E402
from gpt2_source import write_gpt2_source  # noqa: E402
from prep_and_load import SHARED_DATA, SOURCES  # noqa: E402

from common.errors import UserError  # noqa: E402
from data_prep.shards.format import TOKENIZER_DIR, Manifest  # noqa: E402
from data_prep.shards.loader import StreamingLoader  # noqa: E402
from data_prep.tokenizer.load import load_tokenizer  # noqa: E402
from data_prep.write_shards import PrepConfig, write_shards  # noqa: E402
from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations  # noqa: E402
from evaluation.generation.generate import autoregressive_sample  # noqa: E402
from evaluation.inference import inference_mode  # noqa: E402
from model.absorbing import AbsorbingDiffusion  # noqa: E402
from model.denoiser import FunctionDenoiser  # noqa: E402
from model.sampling import SamplingPlan, sample_generators  # noqa: E402
from model.schedules import make_schedule  # noqa: E402
from model.transformer import PRESETS, Transformer, TransformerConfig  # noqa: E402
from pipeline.config import Config, ModelSection, load_config  # noqa: E402
from pipeline.distributed import Distributed, init_distributed  # noqa: E402
from pipeline.training.attention import attention_kernel  # noqa: E402
from pipeline.training.build import network_config  # noqa: E402
from pipeline.training.ema import EMA  # noqa: E402
from pipeline.training.engine import TrainingPlan, build_engine, build_optimizer, plan_training, prepare_model  # noqa: E402
from pipeline.training.init_from import (  # noqa: E402
    InitFrom,
    InitSource,
    adapted_source,
    load_source,
    read_source,
    source_network,
)
from pipeline.training.memory import estimate_memory  # noqa: E402
from pipeline.training.objective import MicroBatchSlot, Objective, engine_model, make_objective  # noqa: E402
from pipeline.training.throughput import (  # noqa: E402
    block_diffusion_flops_per_token,
    flops_per_token,
    forward_flops,
    mfu,
    peak_flops,
)

GPT2_BPE = SHARED_DATA / "gpt2-bpe"
BASES = {"pipeline-zero1": 1, "pipeline-zero2": 2, "torch": None}
ATTENTION_OPTIONS = {"cudnn": "cudnn", "flash": "flash", "efficient": "efficient", "math-attention": "math"}
# Block diffusion (BD3-LM) at block size L': +bd3-4, +bd3-16 (model.block_size; FlexAttention
# on GPU, train.block_attention auto), MFU on the work it does (block_diffusion_flops_per_token).
BD3_OPTIONS = {"bd3-4": 4, "bd3-8": 8, "bd3-16": 16}
OPTIONS = ("compile", "eager", "unpadded", *ATTENTION_OPTIONS, "chunked-ce", "checkpointing", "full-logits",
           "foreach-adamw", "no-pin", "sync", *BD3_OPTIONS, "fp8", "adapt-gpt2", "annealed")
ANNEAL_STEPS = 1_000_000        # +annealed: far past any timed step, so every one is annealed
TORCH_ONLY = ("full-logits", "foreach-adamw")
PIPELINE_ONLY = ("no-pin",)
BEFORE = "pipeline-zero1+eager+unpadded+flash"   # the pipeline as it ran before its GPU defaults
DEFAULT_VARIANTS = [BEFORE, "pipeline-zero1", "pipeline-zero1+flash", "pipeline-zero1+unpadded",
                    "pipeline-zero2", "pipeline-zero1+no-pin", "torch+eager", "torch", "torch+chunked-ce",
                    "torch+full-logits", "torch+checkpointing", "torch+math-attention", "torch+foreach-adamw",
                    "torch+sync"]
# Rows per chunk: the float32 logits of one chunk at V = 50257 are 0.8 GB, and a GEMM of
# 4096 rows keeps the tensor cores busy.
DEFAULT_CHUNK_ROWS = 4096
SAMPLE_STEPS = 1000             # the manual's and the papers' sampling budget
SAMPLE_BATCH = 64               # sequences sampled together: a batch that fills a GPU
SAMPLERS_MEASURED = ("ancestral", "first-hitting")   # cached ancestral and (exact when steps >= seq_len) first-hitting
# Fast generation's rows (docs/fast-generation.md), eager: semi-autoregressive blocks of an eighth of the
# sequence with the same budget, without and with the prefix cache refreshed every PREFIX_REFRESH calls,
# and whole-sequence blocks without and with the dual cache (refreshed as often);
# and the autoregressive network of the same shape with its KV cache, one call per token. Threshold
# decoding's pace is a trained model's confidence (bench/sampler_quality.py), so it has no row here.
BLOCKS_PER_SEQUENCE = 8
PREFIX_REFRESH = 4
EVAL_MASKED_SHARE = 0.5         # the linear schedule's masked share averaged over stratified times: E[t] = 1/2
LM_EVAL_SAMPLES = 16            # `unmask lm-eval --samples`' default
LM_EVAL_REQUESTS = 256
GPU_SEQ_LEN = 1024              # the papers' sequence length
CPU_SEQ_LEN = 64                # a CPU run is a smoke test: short sequences keep it to minutes
KIB = 1024                      # getrusage reports ru_maxrss in KiB on Linux
WARMUP_SAMPLE_STEPS = 8         # a short sampling run first: kernels and allocator


@dataclass(frozen=True)
class Variant:
    """One training setup: the loop and the optimizations switched on."""

    name: str
    zero_stage: int | None      # None: the plain PyTorch loop
    options: frozenset[str]

    def config(self, preset: str, micro_batch: int, chunk_rows: int, num_workers: int) -> Config:
        """The training config of this variant (one micro-batch per step)."""
        compile_ = "true" if "compile" in self.options else "false" if "eager" in self.options else "auto"
        attention = next((ATTENTION_OPTIONS[o] for o in ATTENTION_OPTIONS if o in self.options), "auto")
        overrides = {
            "model.preset": preset, "train.global_batch_size": str(micro_batch),
            "train.micro_batch_size": str(micro_batch), "train.zero_stage": str(self.zero_stage or 1),
            "train.compile": compile_, "train.attention": attention,
            "train.chunked_cross_entropy": str(chunk_rows if "chunked-ce" in self.options else 0),
            "train.activation_checkpointing": str("checkpointing" in self.options).lower(),
            "train.float8": str("fp8" in self.options).lower(), "data.num_workers": str(num_workers)}
        if "unpadded" in self.options:
            overrides["model.vocab_multiple"] = "1"
        if self.block_size is not None:
            overrides["model.block_size"] = str(self.block_size)
        if "annealed" in self.options:
            overrides["adapt.anneal_steps"] = str(ANNEAL_STEPS)
        return load_config(None, overrides)

    @property
    def block_size(self) -> int | None:
        """Block diffusion's L' (a +bd3-N option), or None: MDLM."""
        return next((BD3_OPTIONS[o] for o in BD3_OPTIONS if o in self.options), None)


def parse_variant(name: str) -> Variant:
    """``BASE[+OPTION...]``, e.g. ``torch+compile`` (see the module docstring)."""
    base, *options = name.split("+")
    if base not in BASES:
        raise SystemExit(f"--variants {name}: the base must be one of {sorted(BASES)}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise SystemExit(f"--variants {name}: unknown option {unknown[0]!r}; options are {list(OPTIONS)}")
    for option in options:
        if (option in TORCH_ONLY and BASES[base] is not None) or (option in PIPELINE_ONLY and BASES[base] is None):
            where = "torch loop" if option in TORCH_ONLY else "pipeline bases"
            raise SystemExit(f"--variants {name}: {option} applies to the {where} only")
    if ({"compile", "eager"} <= set(options) or len(set(options) & set(ATTENTION_OPTIONS)) > 1
            or len(set(options) & set(BD3_OPTIONS)) > 1):
        raise SystemExit(f"--variants {name}: contradictory options")
    if "annealed" in options and "adapt-gpt2" not in options:
        raise SystemExit(f"--variants {name}: +annealed applies to an adapted network (+adapt-gpt2) only")
    return Variant(name, BASES[base], frozenset(options))


# ------------------------------------------------------------------ data
def prepare_data(args: argparse.Namespace, scratch: Path) -> Path:
    """--data, or shards of --inputs made by the real prep in ``scratch``."""
    if args.data:
        return Path(args.data)
    inputs = args.inputs or [str(path) for path in SOURCES]
    missing = [path for path in [*inputs, args.tokenizer] if not Path(path).exists()]
    if missing:
        raise SystemExit(f"{missing[0]} is absent: pass --data (an `unmask prep` output) or --inputs and "
                         f"--tokenizer")
    out = scratch / "shards"
    write_shards(PrepConfig(inputs=tuple(inputs), seq_len=args.seq_len), load_tokenizer(args.tokenizer), out,
                 workers=1, progress=False)
    return out


# ------------------------------------------------------------------ training
StepFn = Callable[[int], float]   # step index -> seconds the host waited for data


def _plan(config: Config, network: TransformerConfig, variant: Variant, dist: Distributed) -> TrainingPlan:
    """What the config resolves to here, with the variant's ZeRO stage and checkpointing."""
    return dataclasses.replace(plan_training(config, network, dist.world_size, dist.device),
                               zero_stage=variant.zero_stage or 1,
                               activation_checkpointing=config.train.activation_checkpointing is True)


def _model(network: TransformerConfig, plan: TrainingPlan, source: InitSource | None) -> Transformer:
    """A fresh network with the plan's block-diffusion mask (FlexAttention or dense), as the trainer
    builds it; with an adapted ``source``'s weights."""
    model = Transformer(network, plan.block_attention)
    if source is not None:
        load_source(model, source, network)
    return model


def _adapted(config: Config, network: TransformerConfig, source_dir: Path) -> tuple[TransformerConfig, InitSource]:
    """The network and weights of a run of ``config`` started from the GPT-2 at ``source_dir``,
    as `unmask train --init-from` makes them (pipeline.training.build)."""
    source = read_source(InitFrom(str(source_dir)))
    adapted = source_network(network, source.record, config)
    return adapted, adapted_source(source, adapted, config)


def _objective(config: Config, network: TransformerConfig, validate: bool) -> Objective:
    """The run's objective; an adapted run's anneals before adapt.anneal_steps (TrainingParts.objective)."""
    objective = make_objective(config.model.spec(network), validate=validate,
                               chunk_rows=config.train.chunked_cross_entropy)
    return dataclasses.replace(objective, anneal_steps=config.adapt.anneal_steps) if config.adapt.anneal_steps \
        else objective


def _pipeline_step(config: Config, network: TransformerConfig, plan: TrainingPlan, variant: Variant, data: Path,
                   dist: Distributed, source: InitSource | None) -> tuple[StepFn, Callable[[], None]]:
    """A step of the pipeline's engine, objective and EMA on the real loader; and its teardown."""
    torch.manual_seed(config.train.seed)
    engine = build_engine(_model(network, plan, source).to(dist.device), plan, config.optim, config.train.max_steps,
                          dist.device)
    ema, model = EMA(engine.module, config.train.ema_decay, warmup=config.train.ema_warmup), engine_model(engine)
    objective = _objective(config, network, validate=dist.device.type == "cpu")
    loader = StreamingLoader(data, config.data.train_split, plan.batches.micro_batch, rank=dist.rank,
                             world_size=dist.world_size, seed=config.train.seed,
                             num_workers=config.data.num_workers,
                             pin_memory=dist.device.type == "cuda" and "no-pin" not in variant.options)
    batches = chain.from_iterable(repeat(loader))   # epoch after epoch, as the trainer reads

    def step(index: int) -> float:
        start = time.perf_counter()
        x0 = next(batches)
        waited = time.perf_counter() - start
        x0 = x0.to(dist.device, non_blocking=True)
        slot = MicroBatchSlot(seed=config.train.seed, step=index, rank=dist.rank, world_size=dist.world_size,
                              micro=0, micro_batches=1)
        loss_sum = objective.loss_sum(model, x0, slot)
        engine.backward(loss_sum / x0.numel())
        engine.step()
        if engine.was_step_applied():
            ema.update()
        if "sync" in variant.options:
            loss_sum.item()
        return waited

    return step, engine.destroy


def _torch_step(config: Config, network: TransformerConfig, plan: TrainingPlan, variant: Variant,
                device: torch.device, source: InitSource | None) -> tuple[StepFn, Callable[[], None]]:
    """A step of a plain PyTorch loop on random tokens; and its (empty) teardown."""
    torch.manual_seed(config.train.seed)
    model = _model(network, plan, source).to(device)
    prepare_model(model, checkpointing=plan.activation_checkpointing, compile=plan.compile, float8=plan.float8)
    optimizer = build_optimizer(model, config.optim, device,
                                fused=device.type == "cuda" and "foreach-adamw" not in variant.options)
    objective = _objective(config, network, validate=False)
    # A plain function of the network: the loss then asks for logits at every position and
    # picks the masked rows itself.
    denoiser = FunctionDenoiser(model) if "full-logits" in variant.options else model
    bf16 = plan.precision == "bf16"
    micro, length = config.train.micro_batch_size, network.max_seq_len
    generator = torch.Generator(device).manual_seed(config.train.seed)

    def step(index: int) -> float:
        x0 = torch.randint(0, network.vocab_size, (micro, length), device=device, generator=generator)
        slot = MicroBatchSlot(seed=config.train.seed, step=index, rank=0, world_size=1, micro=0, micro_batches=1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = objective.loss_sum(denoiser, x0, slot) / x0.numel()
        loss.backward()
        if config.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if "sync" in variant.options:
            loss.item()
        return 0.0

    return step, lambda: None


def _timed_steps(step: StepFn, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(mean step seconds, share of the timed wall time spent waiting for data)."""
    for index in range(warmup):
        step(index)
    synchronize(device)
    waited, start = 0.0, time.perf_counter()
    for index in range(warmup, warmup + steps):
        waited += step(index)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return elapsed / steps, waited / elapsed


def _host_rss_bytes() -> int:
    """Resident host memory of this process now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_training(args: argparse.Namespace, preset: str, micro_batch: int, variant: Variant, data: Path,
                     manifest: Manifest, dist: Distributed, scratch: Path) -> dict:
    """One JSON row: a variant's step time, tokens/s, MFU, peak memory and loader wait."""
    device = dist.device
    config = variant.config(preset, micro_batch, args.chunk_rows, args.num_workers)
    network, source = network_config(config.model, manifest), None
    if "adapt-gpt2" in variant.options:  # one GPT-2 per preset, written on first use
        source_dir = scratch / f"gpt2-{preset}"
        if not source_dir.exists():
            write_gpt2_source(source_dir, preset, manifest.seq_len, data / TOKENIZER_DIR)
        network, source = _adapted(config, network, source_dir)
    row = {"bench": "train", "preset": preset, "variant": variant.name, "micro_batch": micro_batch,
           "seq_len": manifest.seq_len, "vocab_size": network.vocab_size, "logit_columns": network.logit_columns,
           "device": device.type, "steps": args.steps, "data": "synthetic" if variant.zero_stage is None else "loader",
           "adapted_from": None if source is None else source.record.family,
           "anneal_steps": config.adapt.anneal_steps if source is not None else None}
    try:
        plan = _plan(config, network, variant, dist)
    except UserError as refusal:  # e.g. +fp8 where FP8 cannot run: a row that says why
        return {**row, "error": str(refusal)}
    row.update(precision=plan.precision, compile=plan.compile, attention=plan.attention, float8=plan.float8,
               estimated_memory_bytes=estimate_memory(config, network, plan).total)
    _release_memory(device)
    torch._dynamo.reset()  # each variant compiles its own graphs
    row["memory_before_bytes"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    try:
        if variant.zero_stage is None:
            step, teardown = _torch_step(config, network, plan, variant, device, source)
        else:
            step, teardown = _pipeline_step(config, network, plan, variant, data, dist, source)
        try:
            with attention_kernel(plan.attention):  # as the trainer runs: the whole run
                step_time, wait_share = _timed_steps(step, args.warmup, args.steps, device)
            row["host_rss_bytes"] = _host_rss_bytes()  # this rank's host memory with the model live
        finally:
            teardown()
    except torch.OutOfMemoryError:
        return {**row, "error": "out of memory"}
    tokens_per_s = micro_batch * manifest.seq_len / step_time
    work = (flops_per_token(network, manifest.seq_len) if variant.block_size is None
            else block_diffusion_flops_per_token(network, manifest.seq_len, variant.block_size))
    return {**row, "step_time_s": step_time, "tokens_per_s": tokens_per_s, "block_size": variant.block_size,
            "mfu": mfu(tokens_per_s, work, peak_flops(device), 1),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "loader_wait_share": None if variant.zero_stage is None else wait_share,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB}


# ------------------------------------------------------------------ evaluation and sampling
def _utilization(network: TransformerConfig, tokens: float, head_rows: float, seconds: float,
                 peak: float | None) -> float | None:
    """Forward FLOPs of the tokens actually passed (pipeline.training.throughput.forward_flops) / time / peak."""
    if peak is None:
        return None
    return forward_flops(network, network.max_seq_len, tokens, head_rows) / seconds / peak


def evaluation_row(network: TransformerConfig, evaluation: dict, peak: float | None) -> dict:
    """bench/eval_throughput.py's figures with the estimator's FLOP utilization: per time sample
    every token passes the blocks and the head runs at the masked rows, EVAL_MASKED_SHARE of them."""
    per_s = evaluation["estimate_tokens_per_s_per_sample"]
    return {"bench": "evaluate", **evaluation,
            "utilization": _utilization(network, per_s, EVAL_MASKED_SHARE * per_s, 1.0, peak),
            "utilization_2n_4ldt": _utilization(network, per_s, per_s, 1.0, peak)}


def measure_sampling(network: TransformerConfig, num_samples: int, plan: SamplingPlan, device: torch.device, *,
                     compiled: bool, peak: float | None) -> dict:
    """Sampling ``num_samples`` sequences from all-mask as ``unmask sample`` runs them
    (``evaluation.generation.generate``: inference mode, evaluation's precision and attention kernel,
    one generator per sample; a fresh network: the cost does not depend on the weights), by
    ``plan`` (cached ancestral: at most one call per step; first-hitting: ceil(seq_len / steps)
    tokens per call; in blocks, per block), its blocks compiled when ``compiled``. Utilization
    (not in blocks): the tokens of every row passed through the blocks, the head at the revealed
    positions (each generated token once)."""
    torch.manual_seed(0)
    model = Transformer(network).to(device).eval()
    if compiled:
        model.compile_parts()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), network.vocab_size, validate=False)

    def sample(sample_steps: int):
        with torch.inference_mode(), inference_mode(model, device):
            return diffusion.sample(model, dataclasses.replace(plan, steps=sample_steps), num_samples=num_samples,
                                    seq_len=network.max_seq_len, generator=sample_generators(plan.seed,
                                                                                             range(num_samples)),
                                    device=device)[1]

    sample(WARMUP_SAMPLE_STEPS)   # kernels, allocator, the compile
    synchronize(device)
    start = time.perf_counter()
    stats = sample(plan.steps)
    synchronize(device)
    elapsed = time.perf_counter() - start
    generated = num_samples * network.max_seq_len
    return {"bench": "sample", "sampler": plan.sampler, "block_len": plan.block_len, "prefix_cache": plan.prefix_cache,
            "whole_sequence": plan.whole_sequence, "dual_cache": plan.dual_cache, "compiled": compiled,
            "seq_len": network.max_seq_len, "vocab_size": network.vocab_size,
            "device": device.type, "num_samples": num_samples, "steps": plan.steps, "tokens_per_s": generated / elapsed,
            "seconds": elapsed, "sequences_per_s": num_samples / elapsed, "network_calls": stats.network_calls,
            "rows_evaluated": stats.rows_evaluated, "seconds_per_call": elapsed / stats.network_calls,
            # In blocks a call's rows vary (the text before its block, a cache's rows): no figure.
            "utilization": None if plan.block_len is not None else _utilization(
                network, stats.rows_evaluated * network.max_seq_len, generated, elapsed, peak)}


def measure_autoregressive_sampling(network: TransformerConfig, num_samples: int, device: torch.device,
                                    peak: float | None) -> dict:
    """Sampling ``num_samples`` sequences from the start token by the autoregressive network of
    ``network``'s shape as ``unmask sample`` runs an autoregressive export
    (``evaluation.generation.generate.autoregressive_sample``: one new row per call against the KV
    cache, uncompiled). Utilization: one row through the blocks and the head per generated token."""
    torch.manual_seed(0)
    causal = dataclasses.replace(network, causal=True)
    model = Transformer(causal).to(device).eval()
    plan, nothing = SamplingPlan(), torch.empty((num_samples, 0), dtype=torch.long, device=device)

    def sample(length: int) -> None:
        with torch.inference_mode(), inference_mode(model, device):
            autoregressive_sample(model, causal.vocab_size, nothing, length, plan,
                                  sample_generators(plan.seed, range(num_samples)))

    sample(WARMUP_SAMPLE_STEPS)
    synchronize(device)
    start = time.perf_counter()
    sample(causal.max_seq_len)
    synchronize(device)
    elapsed = time.perf_counter() - start
    generated = num_samples * causal.max_seq_len
    return {"bench": "sample", "sampler": "autoregressive", "kv_cache": True, "compiled": False,
            "seq_len": causal.max_seq_len, "vocab_size": causal.vocab_size, "device": device.type,
            "num_samples": num_samples, "steps": causal.max_seq_len, "tokens_per_s": generated / elapsed,
            "seconds": elapsed, "sequences_per_s": num_samples / elapsed, "network_calls": causal.max_seq_len,
            "rows_evaluated": generated, "seconds_per_call": elapsed / causal.max_seq_len,
            "utilization": _utilization(causal, generated, generated, elapsed, peak)}


def fast_generation_plans(steps: int, seq_len: int) -> list[SamplingPlan]:
    """The eager rows of fast generation: blocks with ``steps`` calls in all, without and with the
    prefix cache, then whole-sequence blocks without and with the dual cache."""
    block_len = max(1, seq_len // BLOCKS_PER_SEQUENCE)
    blocks = SamplingPlan(sampler="first-hitting", steps=max(1, steps * block_len // seq_len), block_len=block_len)
    whole = dataclasses.replace(blocks, whole_sequence=True)
    return [blocks, dataclasses.replace(blocks, prefix_cache=PREFIX_REFRESH),
            whole, dataclasses.replace(whole, dual_cache=PREFIX_REFRESH)]


def measure_lm_eval(network: TransformerConfig, requests: int, device: torch.device) -> dict:
    """lm-eval's loglikelihood as ``unmask lm-eval`` scores it (evaluation.downstream.likelihoods:
    LM_EVAL_SAMPLES time samples and the greedy pass per request, rows sized to the device):
    ``requests`` (context, continuation) pairs of random tokens, contexts of a quarter to a half
    of the window, continuations of 1 to 4 tokens (LAMBADA-like), requests/s."""
    torch.manual_seed(0)
    model = Transformer(network).to(device).eval()
    scoring = ScoringModel(AbsorbingDiffusion(make_schedule("linear"), network.vocab_size, validate=False), model,
                           network.max_seq_len, device, network)
    generator = torch.Generator().manual_seed(1)
    window = network.max_seq_len

    def tokens(count: int) -> list[int]:
        return torch.randint(0, network.vocab_size, (count,), generator=generator).tolist()

    pairs = [(tokens(int(torch.randint(window // 4, window // 2, (), generator=generator))),
              tokens(int(torch.randint(1, 5, (), generator=generator)))) for _ in range(requests)]
    settings = ScoringSettings(samples=LM_EVAL_SAMPLES, seed=0)
    score_continuations(scoring, pairs[:max(1, requests // 8)], settings)   # warm-up
    synchronize(device)
    start = time.perf_counter()
    score_continuations(scoring, pairs, settings)
    synchronize(device)
    elapsed = time.perf_counter() - start
    passed = sum(len(context) + len(continuation) for context, continuation in pairs) * (LM_EVAL_SAMPLES + 1)
    return {"bench": "lm-eval", "requests": requests, "samples": LM_EVAL_SAMPLES, "device": device.type,
            "seconds": elapsed, "requests_per_s": requests / elapsed, "tokens_per_s": passed / elapsed}


def measure_inference(args: argparse.Namespace, preset: str, manifest: Manifest, device: torch.device) -> list[dict]:
    """The evaluation rows (bench/eval_throughput.py, as before and now), the sampling rows
    (each sampler of SAMPLERS_MEASURED, eager and, on a GPU, compiled) and the lm-eval row."""
    network = network_config(ModelSection(preset=preset, vocab_multiple=1), manifest)  # an export's
    peak = peak_flops(device) or (args.peak_tflops * 1e12 if args.peak_tflops else None)
    rows = []
    for tuned in (False, True):  # as `unmask eval` ran before its GPU defaults, and as it runs now
        evaluation = measure_evaluation(preset, manifest.seq_len, args.eval_samples,
                                        None if tuned else args.eval_batch, args.repeats,
                                        vocab_size=network.vocab_size, blocks=args.eval_blocks, device=str(device),
                                        tuned=tuned)
        rows.append(evaluation_row(network, evaluation, peak))
        torch._dynamo.reset()
    # Compiling on CPU takes minutes of inductor's C++ for nothing (evaluation.inference.should_compile).
    for compiled in (False, True) if device.type == "cuda" else (False,):
        for sampler in SAMPLERS_MEASURED:
            plan = SamplingPlan(sampler=sampler, steps=args.sample_steps)
            rows.append({**measure_sampling(network, args.sample_batch, plan, device, compiled=compiled, peak=peak),
                         "preset": preset})
        torch._dynamo.reset()
    for plan in fast_generation_plans(args.sample_steps, network.max_seq_len):
        rows.append({**measure_sampling(network, args.sample_batch, plan, device, compiled=False, peak=peak),
                     "preset": preset})
    rows.append({**measure_autoregressive_sampling(network, args.sample_batch, device, peak), "preset": preset})
    rows.append({**measure_lm_eval(network, args.lm_eval_requests, device), "preset": preset})
    return rows


# ------------------------------------------------------------------ main
def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["small", "medium"], choices=sorted(PRESETS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="BASE[+OPTION...]; bases "
                        f"{sorted(BASES)}, options {list(OPTIONS)} (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, optimizer state)")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS, help="rows per chunk for +chunked-ce")
    parser.add_argument("--device", default="cuda", help="torch device: cuda or cpu (default: %(default)s)")
    parser.add_argument("--data", help="an `unmask prep` output directory (default: prep --inputs)")
    parser.add_argument("--inputs", nargs="+", help="text files to prep when no --data (default: "
                        "tinyshakespeare and PTB train from ../shared/data)")
    parser.add_argument("--tokenizer", default=str(GPT2_BPE), help="for the prep (default: GPT-2 BPE)")
    parser.add_argument("--seq-len", type=int, help=f"for the prep (default: {GPU_SEQ_LEN} on cuda, "
                        f"{CPU_SEQ_LEN} on cpu)")
    parser.add_argument("--num-workers", type=int, default=1, help="DataLoader workers of the pipeline variants")
    parser.add_argument("--eval-samples", type=int, default=2, help="time samples per block")
    parser.add_argument("--eval-blocks", type=int, default=32, help="blocks scored")
    parser.add_argument("--eval-batch", type=int, default=8, help="blocks per network call of the untuned row "
                        "(the tuned one sizes its batch to the device)")
    parser.add_argument("--repeats", type=int, default=3, help="timed evaluation repeats (median)")
    parser.add_argument("--sample-batch", type=int, default=SAMPLE_BATCH, help="sequences sampled together")
    parser.add_argument("--sample-steps", type=int, default=SAMPLE_STEPS, help="each sampler's budget of calls")
    parser.add_argument("--lm-eval-requests", type=int, default=LM_EVAL_REQUESTS,
                        help="loglikelihood requests scored for the lm-eval row")
    parser.add_argument("--peak-tflops", type=float, help="the device's bf16 peak when pipeline.training.throughput does not "
                        "know it (a CPU dry run passes a nominal one)")
    parser.add_argument("--skip-inference", action="store_true", help="training rows only")
    parser.add_argument("--skip-training", action="store_true", help="evaluation and sampling rows only")
    args = parser.parse_args()
    args.variants = [parse_variant(name) for name in args.variants]
    args.seq_len = args.seq_len or (GPU_SEQ_LEN if args.device == "cuda" else CPU_SEQ_LEN)
    return args


def main() -> None:
    args = _arguments()
    dist = init_distributed()
    if dist.world_size != 1:
        raise SystemExit("run one process: this bench measures one device")
    device = dist.device
    if device.type != args.device:
        # The process group's backend follows the device (NCCL or gloo), so a CPU run on a
        # GPU machine hides the GPUs rather than overriding the device.
        raise SystemExit("--device cuda: no CUDA device here; pass --device cpu" if args.device == "cuda" else
                         f"--device {args.device} on a {device.type} machine: set CUDA_VISIBLE_DEVICES= to run "
                         f"on the CPU")
    print(json.dumps({"bench": "environment", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else platform.processor() or platform.machine(), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "python": platform.python_version()}), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        data = prepare_data(args, Path(scratch))
        manifest = Manifest.read(data)
        for preset in args.presets:
            for micro_batch in [] if args.skip_training else args.micro_batches:
                for variant in args.variants:
                    print(json.dumps(measure_training(args, preset, micro_batch, variant, data, manifest, dist,
                                                      Path(scratch))), flush=True)
            if not args.skip_inference:
                for row in measure_inference(args, preset, manifest, device):
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

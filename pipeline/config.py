"""The training configuration: typed sections, loaded from YAML, overridable from the CLI.

A run's configuration is one ``Config`` of small frozen sections, each owned by the
component that reads it. ``load_config`` reads a YAML file, applies ``--section.field
value`` overrides, coerces every value to its declared type and validates the whole
before any work starts; errors name the file and the field. ``Config.to_dict`` is what
gets logged, checkpointed and compared on resume (``config_differences``): fields marked
``RESUME_SAFE`` may change when a run resumes. ``ModelSection.spec`` is the model a config
trains, as exports record it. The manual: docs/training.md#configuration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from common.bounded_read import read_bounded
from common.errors import UserError
from model.learned import learned_schedule_arguments
from model.schedules import make_schedule
from model.spec import LEARNED_SCHEDULE, ModelSpec
from model.transformer import PRESETS, TransformerConfig

__all__ = [
    "AdaptSection",
    "CheckpointSection",
    "Config",
    "DataSection",
    "DistillSection",
    "EvalSection",
    "LoggingSection",
    "ModelSection",
    "OptimSection",
    "TrainSection",
    "config_differences",
    "distillation_config",
    "load_config",
    "parse_overrides",
    "yaml_problem",
]

RESUME_SAFE = {"resume_safe": True}
# A config's key naming the config it builds on (see _read_layers), and where presets live.
BASE_KEY = "base"
PRESET_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The most a config file may hold: the presets are about 1 KB, a config with every field
# about 5 KB. A path to something else (/dev/zero, a data file) is refused, not read to the end.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelSection:
    """The network shape and the objective it is trained on."""

    preset: str = "tiny"                        # tiny | small | medium | large | xl (model.transformer.PRESETS)
    n_layers: int | None = None                 # None: the preset's value
    d_model: int | None = None                  # None: the preset's value
    n_heads: int | None = None                  # None: the preset's value
    max_seq_len: int | None = None              # None: the data's sequence length
    dropout: float = 0.0                        # 0: no dropout
    time_conditioning: bool = False             # feed t to the denoiser (absorbing: optional; uniform, learned: required)
    objective: Literal["diffusion", "autoregressive"] = "diffusion"   # autoregressive: the causal baseline
    # The diffusion process: absorbing (masking, MD4/MDLM), uniform (D3PM's random
    # replacement) or learned (GenMD4: masking with a learned schedule per token value).
    process: Literal["absorbing", "uniform", "learned"] = "absorbing"
    # model.schedules.make_schedule name. learned: where the per-token exponents start,
    # linear (w = 1) or polynomial (w = power).
    schedule: str = "linear"
    schedule_args: dict = field(default_factory=dict)   # e.g. {power: 2}, {endpoint_eps: 1e-4}
    # Embedding and head rows padded to a multiple of this (tensor-core tiles divide the head's
    # matmul: 50257 -> 50304); the padded logits are -inf, never predicted, and exports drop the
    # padding. 1: no padding.
    vocab_multiple: int = 128
    # Block diffusion (BD3-LM, docs/block-diffusion.md): autoregressive over blocks of this many
    # tokens, masked diffusion inside each; it must divide the sequence length. null: one block,
    # the whole sequence (MDLM). Absorbing process, time-free network.
    block_size: int | None = None
    # Attention restricted to each packed document (the data's EOS ends one) and positions
    # restarting per document, for every objective and block diffusion (model.documents,
    # docs/training.md#document-masking). false: attention over the whole window.
    document_mask: bool = False

    def spec(self, network: TransformerConfig) -> ModelSpec:
        """The model this section trains on ``network``, as an export records it. For the
        learned process ``schedule`` names where the exponents start: the spec's schedule is
        GenMD4's, with the arguments of ``learned_schedule_arguments``."""
        schedule, arguments = self.schedule, dict(self.schedule_args)
        if self.process == "learned":
            schedule, arguments = LEARNED_SCHEDULE, learned_schedule_arguments(make_schedule(schedule, **arguments))
        return ModelSpec(network=network, objective=self.objective, process=self.process, schedule=schedule,
                         schedule_args=arguments, block_size=self.block_size)


@dataclass(frozen=True)
class AdaptSection:
    """How a run started from an autoregressive model becomes a diffusion model (docs/adapting.md)."""

    # Each token predicted at the row before it, from a start row: the source's alignment, so its
    # head goes on predicting the next token (DiffuGPT's shift). false: at its own row (MDLM's).
    shift: bool = True
    # Steps over which the causal attention opens: at step s each key after its query is seen
    # with probability s / anneal_steps (DiffuGPT: 10000). 0: the target's attention from the start.
    anneal_steps: int = 0


@dataclass(frozen=True)
class DataSection:
    """Where the shards are and how they are streamed."""

    # `unmask prep --out` directory or its copy in object storage (s3://bucket/prefix, any
    # pyarrow filesystem URI). It may move between runs: the data's identity is checked by
    # the manifest hash.
    path: str | None = field(default=None, metadata=RESUME_SAFE)
    train_split: str = "train"                  # the split trained on
    val_split: str = "val"                      # the split validated on
    num_workers: int = field(default=1, metadata=RESUME_SAFE)   # DataLoader processes per rank
    # Sequences shuffled together: each global batch draws from a window this long (MosaicML's
    # 2^18; the whole split when smaller). A process holds about 2 windows / ranks of tokens.
    shuffle_window: int = 1 << 18
    # Chunks read from object storage are kept here (None: $XDG_CACHE_HOME/unmask, else ~/.cache/unmask).
    cache_dir: str | None = field(default=None, metadata=RESUME_SAFE)
    cache_gb: float = field(default=50.0, metadata=RESUME_SAFE)   # the cache's size limit; 0: no cache


@dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warmup, then a constant or cosine learning rate."""

    lr: float = 3e-4                            # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)   # AdamW's
    eps: float = 1e-8                           # AdamW's
    weight_decay: float = 0.0                   # on weight matrices only
    warmup_steps: int = 2500                    # linear warmup from 0 to lr
    decay: Literal["constant", "cosine"] = "constant"   # after warmup
    min_lr_ratio: float = 0.1                   # cosine decays to lr * min_lr_ratio at max_steps
    grad_clip: float = 1.0                      # global norm; 0 disables clipping


@dataclass(frozen=True)
class TrainSection:
    """Batching, precision, parallelism, EMA and the run's length."""

    max_steps: int = field(default=1_000_000, metadata=RESUME_SAFE)   # optimizer steps of the whole run
    global_batch_size: int = 512                # sequences per optimizer step, all ranks together
    # Sequences per rank per forward; gradient accumulation makes up the global batch (the
    # sequence of batches does not depend on it). "auto": on GPU the largest that the memory
    # estimate fits in the device (pipeline.training.engine.choose_micro_batch); on CPU, and None,
    # global / world size (no accumulation).
    micro_batch_size: int | Literal["auto"] | None = field(default="auto", metadata=RESUME_SAFE)
    seed: int = 0                               # initial weights, data order, times and masks
    precision: Literal["auto", "fp32", "bf16"] = "auto"   # auto: bf16 on GPU, fp32 on CPU
    zero_stage: Literal["auto", 1, 2, 3] = "auto"         # auto: pipeline.training.engine.choose_zero_stage
    # Recompute each block in the backward instead of keeping its activations. "auto": only
    # when the micro-batch's activations would not fit next to the model states
    # (pipeline.training.engine.activation_memory_bytes); decided per run, from the device's memory.
    activation_checkpointing: bool | Literal["auto"] = False
    # torch.compile each block and the head with its loss (fused kernels; the first steps
    # compile). "auto": on for CUDA (under ZeRO 1 and 2), off for CPU.
    compile: bool | Literal["auto"] = field(default="auto", metadata=RESUME_SAFE)
    # FP8 matmuls in the blocks' four projections (torchao's float8 training, tensorwise scales,
    # compiled): a GPU of compute capability >= 8.9 and the fp8 extra (pip install 'unmask[fp8]').
    # Off until a device check shows it faster with bf16's loss curve (docs/performance.md#fp8).
    float8: bool = field(default=False, metadata=RESUME_SAFE)
    # The attention kernel (torch SDPA's backend). "auto": the fastest this device runs at the
    # training dtype (cudnn, then flash, then efficient on GPU; flash on CPU); one it cannot
    # run is refused before training starts.
    attention: Literal["auto", "cudnn", "flash", "efficient", "math"] = field(default="auto", metadata=RESUME_SAFE)
    # Block diffusion's attention mask (model.block_size), and document masking's
    # (model.document_mask): "flex", FlexAttention with a compiled block mask (GPU), or "dense",
    # SDPA with a boolean mask (train.attention's kernel). "auto": flex where it runs (GPU, no
    # dropout), dense otherwise.
    block_attention: Literal["auto", "flex", "dense"] = field(default="auto", metadata=RESUME_SAFE)
    # Block diffusion, training only: each block's masking rate drawn in [beta, omega] (the
    # paper's clipped schedule, less variance); evaluation and validation always bound over the
    # full t in (0, 1]. [0, 1]: no clipping.
    block_mask_rate: tuple[float, float] = (0.0, 1.0)
    # Block diffusion: at every validation, train on the [beta, omega] of least clipped-loss
    # variance on the validation batches (pipeline.training.mask_rate_search; block_mask_rate is the
    # first interval). Costs 25 validations' forwards per validation.
    block_mask_rate_search: bool = False
    # Rows per chunk of the output head + cross-entropy (model.cross_entropy): bounds the loss's
    # memory by rows x vocabulary instead of masked tokens x vocabulary; 0: all rows at once.
    chunked_cross_entropy: int = 0
    ema_decay: float = 0.9999                   # 0 keeps a copy of the weights
    ema_warmup: bool = True                     # decay min(ema_decay, (1 + n) / (10 + n)) after n updates
    max_skipped_steps: int = 10                 # consecutive non-finite steps before aborting


@dataclass(frozen=True)
class EvalSection:
    """Periodic validation on the val split, with the EMA weights."""

    every: int = field(default=1000, metadata=RESUME_SAFE)   # steps; 0: only at the end
    batches: int | None = field(default=None, metadata=RESUME_SAFE)   # per rank; None: the whole split
    micro_batch_size: int | None = field(default=None, metadata=RESUME_SAFE)  # None: train's
    seed: int = 1234                            # fixes the times and masks of every validation


@dataclass(frozen=True)
class CheckpointSection:
    """When checkpoints are written, and how many are kept."""
    every: int = field(default=1000, metadata=RESUME_SAFE)   # steps; also at the end and on SIGTERM
    keep_last: int = field(default=3, metadata=RESUME_SAFE)   # older checkpoints are deleted
    # true: the steps go on while a checkpoint is written (a host copy of its tensors is kept meanwhile)
    asynchronous: bool = field(default=False, metadata=RESUME_SAFE)


@dataclass(frozen=True)
class LoggingSection:
    """Where and how often metrics go: the log, the progress bar, MLflow."""
    every: int = field(default=10, metadata=RESUME_SAFE)     # steps between metric logs
    mlflow_uri: str | None = field(default=None, metadata=RESUME_SAFE)  # None: $MLFLOW_TRACKING_URI or the shared store
    experiment: str = field(default="unmask", metadata=RESUME_SAFE)   # MLflow experiment name
    run_name: str | None = field(default=None, metadata=RESUME_SAFE)  # None: the run dir's name
    progress: bool = field(default=True, metadata=RESUME_SAFE)        # a progress bar on rank 0
    mlflow: bool = field(default=True, metadata=RESUME_SAFE)          # false: metrics.jsonl only, no MLflow run
    # A tracking server that does not answer at the start stops the run (within 30 s);
    # false: train without it, with a warning (metrics stay in RUN/metrics.jsonl).
    mlflow_required: bool = field(default=True, metadata=RESUME_SAFE)
    # seconds between samples of the machine's metrics (CPU, host memory, and per GPU utilisation,
    # memory and power) in the MLflow run's System metrics; 0: none
    system_metrics_interval: float = field(default=10.0, metadata=RESUME_SAFE)


@dataclass(frozen=True)
class DistillSection:
    """Self-distillation through time (``unmask distill``, docs/fast-generation.md#self-distillation).

    Round k's teacher samples in ``start_steps / 2^k`` steps and its student learns to do one
    step for the teacher's two; ``log2(start_steps / end_steps)`` rounds of ``round_steps``
    optimizer steps each make the run (``train.max_steps``).
    """

    enabled: bool = False                       # set by `unmask distill`; `unmask train` refuses it
    start_steps: int = 1024                     # the first teacher's sampling steps
    end_steps: int = 8                          # the last student's sampling steps
    round_steps: int = 500                      # optimizer steps per round
    # How the student's x0 distribution is compared with the teacher's two-step targets, per
    # masked position: reverse_kl KL(student || teacher) (SDTT's best), forward_kl, mse (on the
    # log-probabilities), tvd (total variation).
    divergence: Literal["reverse_kl", "forward_kl", "mse", "tvd"] = "reverse_kl"
    # true: each round's student (its EMA weights) becomes the next round's teacher (SDTT);
    # false: the first teacher teaches every round.
    refresh_teacher: bool = True

    @property
    def rounds(self) -> int:
        return max(1, round(math.log2(self.start_steps / self.end_steps)))

    def round_of(self, step: int) -> int:
        """The round that optimizer step ``step`` (0-based: the step about to run) belongs to."""
        return min(step // self.round_steps, self.rounds - 1)

    def teacher_steps(self, round_: int) -> int:
        """The sampling steps of round ``round_``'s teacher; its student's are half."""
        return self.start_steps >> round_

    def student_record(self, step: int) -> dict[str, Any]:
        """What an export of the student at optimizer step ``step`` records of its distillation."""
        round_ = self.round_of(max(step - 1, 0))
        return {"steps": self.teacher_steps(round_) // 2, "round": round_ + 1, "rounds": self.rounds,
                "round_complete": step == (round_ + 1) * self.round_steps, "start_steps": self.start_steps,
                "divergence": self.divergence, "refresh_teacher": self.refresh_teacher}


@dataclass(frozen=True)
class Config:
    """The whole configuration of a run: one typed section per component."""
    model: ModelSection = field(default_factory=ModelSection)
    adapt: AdaptSection = field(default_factory=AdaptSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-able values (tuples as lists), section by section."""
        return {f.name: {k: list(v) if isinstance(v, tuple) else v
                         for k, v in vars(getattr(self, f.name)).items()} for f in fields(self)}

    def sha256(self) -> str:
        """The hash of the resolved config, as checkpoints record it."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def validate(self) -> "Config":
        """Raise UserError naming the first invalid field; return self."""
        for name, ok, why in _checks(self):
            if not ok:
                raise UserError(f"config field {name} = {_field_value(self, name)!r}: {why}")
        try:
            schedule = make_schedule(self.model.schedule, **self.model.schedule_args)
            if self.model.process == "learned":
                learned_schedule_arguments(schedule)
        except ValueError as err:
            learned = " (model.process = learned)" if self.model.process == "learned" else ""
            raise UserError(f"config field model.schedule / model.schedule_args{learned}: {err}") from None
        return self


def distillation_config(config: Config, *, max_steps_given: bool) -> Config:
    """``config`` as ``unmask distill`` runs it: distillation on, and ``train.max_steps`` its rounds'
    steps unless the command line gave it (then the checks hold it to them)."""
    distill = replace(config.distill, enabled=True)
    steps = distill.rounds * distill.round_steps
    if max_steps_given and config.train.max_steps != steps:
        raise UserError(f"config field train.max_steps = {config.train.max_steps}: a distillation is {distill.rounds} "
                        f"rounds of distill.round_steps = {distill.round_steps}: set {steps}, or leave it to "
                        f"unmask distill")
    return replace(config, distill=distill, train=replace(config.train, max_steps=steps)).validate()


def _field_value(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _kind(model: ModelSection) -> str:
    """The process trained (or the autoregressive objective), for messages."""
    return f"the {model.process} process" if model.objective == "diffusion" else "the autoregressive baseline"


def _checks(c: Config) -> list[tuple[str, bool, str]]:
    positive = "must be >= 1"
    m, o, t = c.model, c.optim, c.train
    return [
        ("model.preset", m.preset in PRESETS, f"choose one of {sorted(PRESETS)}"),
        ("model.n_layers", m.n_layers is None or m.n_layers >= 1, positive),
        ("model.d_model", m.d_model is None or m.d_model >= 1, positive),
        ("model.n_heads", m.n_heads is None or m.n_heads >= 1, positive),
        ("model.max_seq_len", m.max_seq_len is None or m.max_seq_len >= 1, positive),
        ("model.dropout", 0.0 <= m.dropout < 1.0, "must lie in [0, 1)"),
        ("model.time_conditioning", not (m.time_conditioning and m.objective == "autoregressive"),
         "the autoregressive baseline takes no time conditioning"),
        ("model.process", m.process == "absorbing" or m.objective == "diffusion",
         "the autoregressive baseline has no diffusion process; leave it at absorbing"),
        ("model.time_conditioning", m.time_conditioning or m.process == "absorbing",
         (f"the {m.process} process needs it (set true): its best denoiser depends on t (how far "
          "to trust z_t), and a time-free one leaves its bound far above the absorbing one's")),
        ("model.block_size", m.block_size is None or m.block_size >= 1, f"{positive} (null: MDLM, one block)"),
        ("model.block_size", m.block_size is None or (m.objective, m.process) == ("diffusion", "absorbing"),
         f"block diffusion applies to the absorbing diffusion only (not to {_kind(m)}: its per-block bound is not "
         "implemented); set null"),
        ("model.block_size", m.block_size is None or not m.time_conditioning,
         "block diffusion trains a time-free network (each block has its own time); set model.time_conditioning false"),
        ("train.block_mask_rate", 0.0 <= t.block_mask_rate[0] < t.block_mask_rate[1] <= 1.0,
         "must be [beta, omega] with 0 <= beta < omega <= 1"),
        ("train.block_mask_rate", m.block_size is not None or tuple(t.block_mask_rate) == (0.0, 1.0),
         "clips block diffusion's masking rates: set model.block_size, or leave it [0, 1]"),
        ("train.block_attention", m.block_size is not None or m.document_mask or t.block_attention == "auto",
         ("chooses block diffusion's or document masking's attention mask, and without either there is none: set "
          "model.block_size or model.document_mask, or leave it auto")),
        ("train.block_mask_rate_search", m.block_size is not None or not t.block_mask_rate_search,
         "searches block diffusion's masking-rate interval: set model.block_size, or leave it false"),
        ("train.block_mask_rate_search", not t.block_mask_rate_search or c.eval.every > 0,
         "runs at every validation: set eval.every > 0"),
        ("adapt.anneal_steps", c.adapt.anneal_steps >= 0, "must be >= 0 (0: the target's attention from the start)"),
        ("data.num_workers", c.data.num_workers >= 0, "must be >= 0"),
        ("data.shuffle_window", c.data.shuffle_window >= 1, "must be >= 1 (sequences)"),
        ("data.shuffle_window", c.data.shuffle_window >= t.global_batch_size,
         (f"is fewer sequences than one global batch (train.global_batch_size = {t.global_batch_size}), and a "
          f"window holds whole global batches: it would be one batch; set at least {t.global_batch_size}")),
        ("data.cache_gb", c.data.cache_gb >= 0, "must be >= 0"),
        ("optim.lr", o.lr > 0 and math.isfinite(o.lr), "must be a positive number"),
        ("optim.betas", all(0.0 <= b < 1.0 for b in o.betas), "both must lie in [0, 1)"),
        ("optim.eps", o.eps > 0, "must be > 0"),
        ("optim.weight_decay", o.weight_decay >= 0, "must be >= 0"),
        ("optim.warmup_steps", o.warmup_steps >= 0, "must be >= 0"),
        ("optim.min_lr_ratio", 0.0 <= o.min_lr_ratio <= 1.0, "must lie in [0, 1]"),
        ("optim.grad_clip", 0 <= o.grad_clip < math.inf, "must be a finite number >= 0 (0 disables clipping)"),
        ("train.max_steps", t.max_steps >= 1, positive),
        ("train.global_batch_size", t.global_batch_size >= 1, positive),
        ("model.vocab_multiple", m.vocab_multiple >= 1, f"{positive} (1: no padding)"),
        ("train.micro_batch_size", not isinstance(t.micro_batch_size, int) or t.micro_batch_size >= 1, positive),
        # (The list is built before it is checked: no modulo by a size that the check above refuses.)
        ("train.micro_batch_size", not isinstance(t.micro_batch_size, int) or t.micro_batch_size < 1
         or t.global_batch_size % t.micro_batch_size == 0,
         f"must divide train.global_batch_size = {t.global_batch_size}"),
        ("train.seed", t.seed >= 0, "must be >= 0"),
        ("train.ema_decay", 0.0 <= t.ema_decay < 1.0, "must lie in [0, 1)"),
        ("train.max_skipped_steps", t.max_skipped_steps >= 1, positive),
        ("train.chunked_cross_entropy", t.chunked_cross_entropy >= 0, "must be >= 0 (0: off)"),
        ("train.chunked_cross_entropy", t.chunked_cross_entropy == 0 or m.objective == "diffusion",
         "applies to the diffusion objective only; set 0 for model.objective = autoregressive"),
        ("train.chunked_cross_entropy", t.chunked_cross_entropy == 0 or m.process == "absorbing",
         (f"applies to the absorbing process only: the {m.process} process needs the whole prediction "
          "over the vocabulary at every scored position; set 0")),
        ("eval.every", c.eval.every >= 0, "must be >= 0 (0: only at the end)"),
        ("eval.batches", c.eval.batches is None or c.eval.batches >= 1, positive),
        ("eval.micro_batch_size", c.eval.micro_batch_size is None or c.eval.micro_batch_size >= 1, positive),
        ("checkpoint.every", c.checkpoint.every >= 1, positive),
        ("checkpoint.keep_last", c.checkpoint.keep_last >= 1, positive),
        ("logging.every", c.logging.every >= 1, positive),
        ("logging.system_metrics_interval", c.logging.system_metrics_interval >= 0,
         "must be >= 0 (seconds; 0: no system metrics)"),
        *_distill_checks(c),
    ]


def _halves_to(start: int, end: int) -> bool:
    """Whether ``end`` is ``start`` halved at least once: start = end * 2^k, k >= 1."""
    return 1 <= end < start and start % end == 0 and (start // end) & (start // end - 1) == 0


def _distill_checks(c: Config) -> list[tuple[str, bool, str]]:
    """``distill``'s fields, and what self-distillation refuses (docs/fast-generation.md#self-distillation)."""
    d, m = c.distill, c.model
    off = not d.enabled
    return [
        ("distill.start_steps", d.start_steps >= 2, "must be >= 2 (the first teacher's sampling steps)"),
        ("distill.end_steps", _halves_to(d.start_steps, d.end_steps),
         (f"must be distill.start_steps = {d.start_steps} halved one or more times (each round halves the steps), "
         f"e.g. {max(1, d.start_steps // 128)}")),
        ("distill.round_steps", d.round_steps >= 1, "must be >= 1"),
        ("model.objective", off or m.objective == "diffusion",
         "self-distillation trains a diffusion student; the autoregressive baseline has no sampling steps to halve"),
        ("model.process", off or m.process != "uniform",
         ("self-distillation supports the absorbing process only: SDTT's two-step targets rest on a revealed "
         "token staying fixed, and Duo's DCD distils the uniform process through its Gaussian counterpart, "
         "which unmask's uniform process has no counterpart of; distil an absorbing model")),
        ("model.process", off or m.process != "learned",
         ("self-distillation supports the absorbing process only: under the learned schedule a masked "
         "position's chance to be revealed depends on its (unknown) token, so the teacher's step is not "
         "the reveal-then-draw that SDTT's targets are built from; distil an absorbing model")),
        ("model.block_size", off or m.block_size is None,
         ("self-distillation is built for whole-sequence (MDLM) models: block diffusion samples block by "
         "block with the clean blocks in context, which its two-step targets do not follow; set null")),
    ]


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: dict[str, str] | None = None) -> Config:
    """Read a YAML config (None: the defaults) and the configs it builds on (``base:``),
    apply ``{"section.field": "value"}`` overrides (as strings, coerced like YAML values),
    and validate."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw = _read_layers(Path(path), ())
    config = _build(Config, raw, source, "")
    for dotted, text in (overrides or {}).items():
        config = _override(config, dotted, text)
    return config.validate()


def _read_layers(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The sections of ``path`` over those of its ``base:`` (and its base's...), field by
    field: a config names a preset it starts from and says only what differs."""
    loaded = _read_yaml(path)
    if loaded is None:
        _warn_empty(path)
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, train:, ...), "
                        f"not {type(loaded).__name__} {loaded!r:.40}")
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    base_path = _base_path(base, path)
    if base_path.resolve() in {p.resolve() for p in (*chain, path)}:
        cycle = " -> ".join(str(p) for p in (*chain, path, base_path))
        raise UserError(f"{path}: base: {base!r} makes a cycle ({cycle}); a config may not build on itself")
    return _merge(_read_layers(base_path, (*chain, path)), loaded)


def _base_path(base: Any, path: Path) -> Path:
    """``base:`` is a path relative to the config that names it, or a shipped preset's name."""
    if not isinstance(base, str) or not base:
        raise UserError(f"{path}: base: must name a config file or a preset ({', '.join(shipped_configs())}), "
                        f"got {base!r}")
    for candidate in (path.parent / base, PRESET_CONFIGS / base, PRESET_CONFIGS / f"{base}.yaml"):
        if candidate.is_file():
            return candidate
    raise UserError(f"{path}: base: {base!r} is neither a file next to it nor a preset; presets: "
                    f"{', '.join(shipped_configs())}")


def shipped_configs() -> list[str]:
    """The names of the presets in configs/ (what ``base:`` may name without a path)."""
    return sorted(p.stem for p in PRESET_CONFIGS.glob("*.yaml"))


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override``'s sections over ``base``'s, field by field."""
    merged = dict(base)
    for section, fields_ in override.items():
        if isinstance(fields_, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **fields_}
        else:
            merged[section] = fields_
    return merged


def _read_yaml(path: Path) -> Any:
    """The YAML value of a config file; a UserError naming the file (line, column) and the fix."""
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a YAML config file; pass a file such as "
                        f"configs/tiny.yaml to --config")
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES, "a YAML config file")
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read the config file ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = data.count(b"\n", 0, err.start) + 1, err.start - data.rfind(b"\n", 0, err.start)
        raise UserError(f"{path} line {line}, column {column}: byte 0x{data[err.start]:02x} is not "
                        f"UTF-8; save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise UserError(f"{path}{yaml_problem(err)}; fix the YAML there") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping. YAML requires unique
    keys, and PyYAML would keep the last silently: a second ``train:`` section would drop every
    field of the first."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            seen = first.setdefault(key, key_node.start_mark)
        except TypeError:  # an unhashable key: construct_mapping names it
            break
        if seen is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice (first at line {seen.line + 1})", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def yaml_problem(err: yaml.YAMLError) -> str:
    """" line L, column C: not valid YAML: PROBLEM (CONTEXT at line L', column C')", one line."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f": not valid YAML ({' '.join(str(err).split())})"
    where = f" line {mark.line + 1}, column {mark.column + 1}"
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None:
        context = f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return f"{where}: not valid YAML: {err.problem}{context or ''}"


# Config files already warned about as empty, so that `unmask run` (which loads the config
# again for its train stage) says it once.
_WARNED_EMPTY: set[str] = set()


def config_yaml(config: Config) -> str:
    """The resolved config as YAML, every field written out (what ``--print-config`` shows):
    a file that ``load_config`` reads back to the same config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)


def _warn_empty(path: Path) -> None:
    """An empty config (or only comments) is allowed, but what it means is worth saying."""
    if str(path) in _WARNED_EMPTY or os.environ.get("RANK", "0") != "0":
        return
    _WARNED_EMPTY.add(str(path))
    defaults = Config()
    logging.getLogger("unmask.config").warning(
        "warning: %s holds no settings (empty, or only comments): every field keeps its default, "
        "including train.max_steps = %d, train.global_batch_size = %d and model.preset = %r; "
        "write the fields to change into it (docs/training.md: the config reference)",
        path, defaults.train.max_steps, defaults.train.global_batch_size, defaults.model.preset)


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{source}: unknown field {prefix}{unknown[0]}; {prefix.rstrip('.') or 'config'} "
                        f"has {sorted(known)}")
    values = {}
    for name, value in raw.items():
        if is_dataclass(hints[name]):
            values[name] = _build(hints[name], value or {}, source, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, hints[name], f"{source}: field {prefix}{name}")
    return cls(**values)


def _override(config: Config, dotted: str, text: str) -> Config:
    section_name, _, key = dotted.partition(".")
    if not hasattr(config, section_name) or not key:
        raise UserError(f"unknown config override --{dotted}; use --SECTION.FIELD with a section of "
                        f"{[f.name for f in fields(config)]}")
    section = getattr(config, section_name)
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        raise UserError(f"unknown config override --{dotted}; {section_name} has {sorted(hints)}")
    try:
        parsed = yaml.load(text, Loader=_UniqueKeyLoader) if text != "" else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise UserError(f"flag --{dotted} {text!r}: not a valid YAML value ({problem}); write it as in "
                        f"the config file, quoted for the shell") from None
    value = _coerce(parsed, hints[key], f"flag --{dotted}")
    return replace(config, **{section_name: replace(section, **{key: value})})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Coerce a YAML value to the declared type or raise UserError naming ``where``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce_union(value, [a for a in args if a is not type(None)], where)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise UserError(f"{where} = {value!r}: choose one of {list(args)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"{where} = {value!r}: expected a list of {len(args)} values")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where} = {value!r}: expected a mapping")
        return dict(value)
    return _scalar(value, hint, where)


def _coerce_union(value: Any, hints: list[Any], where: str) -> Any:
    """The value as the first of ``hints`` that accepts it; the error lists what each expects."""
    reasons = []
    for hint in hints:
        try:
            return _coerce(value, hint, where)
        except UserError as err:
            reasons.append(str(err).removeprefix(f"{where} = {value!r}: "))
    raise UserError(f"{where} = {value!r}: " + ", or ".join(reasons))


def _scalar(value: Any, hint: type, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{where} = {value!r}: expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{where} = {value!r}: expected an integer")
    if hint is float:
        # YAML 1.1 reads "3e-4" (no dot) as a string; accept any numeric text.
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{where} = {value!r}: expected a number") from None
        if not math.isfinite(number):  # YAML's .inf and .nan: no field means "no limit" by them
            raise UserError(f"{where} = {value!r}: expected a finite number")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{where} = {value!r}: expected a string")
    raise TypeError(f"unsupported config type {hint!r} at {where}")


# --------------------------------------------------------------------------- CLI and resume
def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--optim.lr", "1e-4", "--train.seed=3"]`` -> ``{"optim.lr": "1e-4", "train.seed": "3"}``; a key
    given twice is refused, as in a YAML file."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unrecognized argument {arg!r}; config overrides look like --optim.lr 1e-4")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise UserError(f"config override {arg} needs a value")
            key, value = arg[2:], args[i + 1]
            i += 2
        if key in overrides:  # as a key given twice in a YAML mapping: refused, not the last one kept
            raise UserError(f"config override --{key} is given twice ({overrides[key]!r}, then {value!r}); "
                            f"give it once")
        overrides[key] = value
    return overrides


def config_differences(saved: dict, current: dict, *, include_resume_safe: bool = False) -> list[str]:
    """Fields that differ between a checkpoint's config and this one, as
    ``"optim.lr: checkpoint 0.0003, now 0.0001"``; RESUME_SAFE fields only when asked. A field
    ``saved`` lacks shows as ``checkpoint None``."""
    safe = set() if include_resume_safe else {
        f"{s.name}.{f.name}" for s in fields(Config)
        for f in fields(typing.get_type_hints(Config)[s.name]) if f.metadata.get("resume_safe")}
    differ = []
    for section, values in current.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            old = saved.get(section, {}).get(key)
            if name not in safe and old != value:
                differ.append(f"{name}: checkpoint {old!r}, now {value!r}")
    return differ

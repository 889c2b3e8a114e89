"""A training run's parts, built from its config and its data before any step.

``build_parts`` resolves, in this order: the data's manifest and tokenizer
(``find_tokenizer``), the network (``network_config``, with an --init-from source's
architecture, or its network whole: a Hugging Face model, an autoregressive source adapted),
the ``TrainingPlan`` (every "auto" decided), the loaders, the trained module (built complete
from the config by ``model.spec.build_trainable``, from ``train.seed``: the same weights on
every rank; a source's weights are loaded before DeepSpeed partitions it), the engine, the EMA
and the objective (an adapted run's anneals its attention: ``model.annealing``).
``TrainingParts`` then says what a checkpoint records of the run (``meta``), what its MLflow
run does (``identity``) and what the first log line does (``setup_line``). The manual:
docs/training.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from common.errors import UserError
from common.provenance import git_commit
from common.units import GIB
from data_prep.shards.format import TOKENIZER_DIR, Manifest
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import ChunkCache, cache_root, is_remote, localize_metadata
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.load import load_tokenizer
from model.spec import build_trainable
from model.transformer import TransformerConfig, preset
from pipeline.config import Config, ModelSection
from pipeline.distributed import Distributed
from pipeline.run_dir.checkpoint import CheckpointMeta, TrainState
from pipeline.run_dir.layout import RunLayout
from pipeline.tracking.run_records import RunIdentity
from pipeline.training.adaptation import check_not_adapting, is_adaptation
from pipeline.training.ema import EMA
from pipeline.training.engine import TrainingPlan, build_engine, deepspeed_config, plan_training
from pipeline.training.init_from import (
    InitRecord,
    InitSource,
    adapted_source,
    check_tokenizer,
    load_source,
    source_network,
)
from pipeline.training.memory import check_memory, estimate_memory, rank_memory_bytes
from pipeline.training.objective import DiffusionObjective, Objective, TrainedModel, engine_model, make_objective
from pipeline.training.throughput import block_diffusion_flops_per_token, flops_per_token, peak_flops

__all__ = ["TrainingParts", "build_parts", "find_tokenizer", "network_config", "training_flops_per_token"]


@dataclass(frozen=True)
class TrainingParts:
    """What the loop runs: the data, the network and its plan, the engine, EMA and objective."""

    config: Config
    dist: Distributed
    data_dir: str | Path
    manifest: Manifest
    tokenizer: Tokenizer
    network: TransformerConfig
    plan: TrainingPlan
    train_loader: StreamingLoader
    val_loader: StreamingLoader
    engine: nn.Module                # DeepSpeed's engine around the trained module
    ema: EMA
    model: TrainedModel              # the engine as the objectives call it (``engine_model``)
    bound: Objective                 # the full bound: what validation reports
    init_from: InitRecord | None     # where the first weights came from (--init-from)
    flops_per_token: float
    peak_flops: float | None

    @property
    def anneal_steps(self) -> int:
        """Steps over which an adapted run's attention opens (``adapt.anneal_steps``); 0 for any other run."""
        adapted = self.init_from is not None and self.init_from.adaptation is not None
        return self.config.adapt.anneal_steps if adapted else 0

    def objective(self, mask_rate: tuple[float, float]) -> Objective:
        """What the loop trains on: the bound, block diffusion's clipped to ``mask_rate``, an
        adapted run's with its attention annealed."""
        if not isinstance(self.bound, DiffusionObjective):
            return self.bound
        return replace(self.bound.clipped(mask_rate), anneal_steps=self.anneal_steps)

    def meta(self, state: TrainState) -> CheckpointMeta:
        """What a checkpoint of this run at ``state`` records besides its tensors."""
        return CheckpointMeta(state=replace(state), config=self.config.to_dict(), config_sha256=self.config.sha256(),
                              data_sha256=self.manifest.sha256(), tokenizer_sha256=self.tokenizer.sha256,
                              network=asdict(self.network), zero_stage=self.plan.zero_stage,
                              precision=self.plan.precision, batch_plan=asdict(self.plan.batches),
                              world_size=self.dist.world_size,
                              init_from=self.init_from.to_json() if self.init_from else None)

    def identity(self, changes: list[str], step: int) -> RunIdentity:
        """The params, tags and config artifacts of the run's MLflow run; ``changes``: the
        config fields changed at the resume from ``step``."""
        plan, config = self.plan, self.config
        resolved = {"world_size": self.dist.world_size, "micro_batch": plan.batches.micro_batch,
                    "accumulation": plan.batches.accumulation, "zero_stage": plan.zero_stage,
                    "precision": plan.precision, "parameters": plan.parameters,
                    "activation_checkpointing": plan.activation_checkpointing, "compile": plan.compile,
                    "attention": plan.attention, "float8": plan.float8, "seq_len": self.manifest.seq_len,
                    "vocab_size": self.network.vocab_size,
                    "network": asdict(self.network)}  # the shape the preset and overrides resolved to
        if config.model.block_size is not None or config.model.document_mask:
            resolved["block_attention"] = plan.block_attention
        params = {**config.to_dict(), "resolved": resolved}
        tags = {"git_commit": git_commit(), "data_manifest_sha256": self.manifest.sha256(),
                "tokenizer_sha256": self.tokenizer.sha256, "data_dir": str(self.data_dir)}
        if self.init_from is not None:  # the source of the first weights (its network is in resolved)
            params["init_from"] = {k: v for k, v in self.init_from.to_json().items() if k != "network"}
            tags.update(init_from=self.init_from.source, init_from_sha256=self.init_from.sha256)
            if self.init_from.family is not None:
                tags["init_from_family"] = self.init_from.family
        texts = {RunLayout(Path()).config.name: json.dumps(config.to_dict(), indent=2),
                 "deepspeed_config.json": json.dumps(deepspeed_config(plan, config.optim), indent=2)}
        return RunIdentity(params, tags, texts, changes, step)

    def setup_line(self) -> str:
        """What the run resolved to, "auto" settings included: the line to read when it is slow."""
        plan, batches, train = self.plan, self.plan.batches, self.config.train
        chunks = f"{plan.chunked_cross_entropy} rows" if plan.chunked_cross_entropy else "off"
        return (f"setup: {batches.world_size} rank(s), micro-batch {batches.micro_batch}{_auto(train.micro_batch_size)} "
                f"x {batches.accumulation} accumulation, ZeRO-{plan.zero_stage}, {plan.precision}, FP8 "
                f"{'on' if plan.float8 else 'off'}, activation "
                f"checkpointing {'on' if plan.activation_checkpointing else 'off'}{_auto(train.activation_checkpointing)}, "
                f"compile {'on' if plan.compile else 'off'}{_auto(train.compile)}, attention {plan.attention}"
                f"{_auto(train.attention)}, chunked cross-entropy {chunks}, vocabulary {self.network.vocab_size} padded "
                f"to {self.network.logit_columns}, memory {self.memory_line()}")

    def memory_line(self) -> str:
        """The memory estimate per rank (``pipeline.training.memory``) and what a rank has."""
        estimate = estimate_memory(self.config, self.network, self.plan)
        return f"{estimate.parts()} estimated of {rank_memory_bytes(self.dist.device) / GIB:.1f} GiB"


def _auto(setting: object) -> str:
    """" (auto)" after a value that an "auto" setting decided."""
    return " (auto)" if setting == "auto" else ""


def build_parts(config: Config, data_dir: str | Path, dist: Distributed,
                start: InitRecord | InitSource | None) -> TrainingParts:
    """The parts of a run on the shards in ``data_dir``. ``start``: the source a run started
    with --init-from begins from (an ``InitSource``, loaded into the new network), or the
    record of the one it began from (an ``InitRecord``: a resumed run, whose network takes the
    source's architecture and whose weights come from its own checkpoint)."""
    # From object storage, the manifest and the tokenizer are read from a local copy.
    cache = cache_root(config.data.cache_dir) if is_remote(data_dir) else None
    metadata = localize_metadata(str(data_dir), cache) if cache is not None else Path(data_dir)
    manifest = Manifest.read(metadata)
    tokenizer = find_tokenizer(manifest, metadata, str(data_dir) if cache is not None else None)
    init_from = start.record if isinstance(start, InitSource) else start
    if isinstance(start, InitSource):
        check_tokenizer(start.record, tokenizer.sha256, data_dir)
    network = network_config(config.model, manifest)
    check_masked_tokens(config, manifest.seq_len)
    if init_from is None:
        check_not_adapting(config.adapt)
    else:
        network = source_network(network, init_from, config)
        if isinstance(start, InitSource) and is_adaptation(init_from.network, config):
            start = adapted_source(start, network, config)
            init_from = start.record
    plan = plan_training(config, network, dist.world_size, dist.device)
    # Before the first step, and before anything is loaded or allocated.
    check_memory(estimate_memory(config, network, plan), plan, network, rank_memory_bytes(dist.device))
    train_loader, val_loader = _loaders(config, data_dir, dist, plan, cache)
    spec, validate = config.model.spec(network), dist.device.type == "cpu"
    torch.manual_seed(config.train.seed)  # the same initial weights on every rank
    module = build_trainable(spec, validate=validate, block_attention=plan.block_attention)
    if isinstance(start, InitSource):  # before DeepSpeed partitions it: every ZeRO stage gets these values
        load_source(module, start, network)
    engine = build_engine(module.to(dist.device), plan, config.optim, config.train.max_steps, dist.device)
    ema = EMA(engine.module, config.train.ema_decay, warmup=config.train.ema_warmup)
    bound = make_objective(spec, validate=validate, chunk_rows=config.train.chunked_cross_entropy)
    return TrainingParts(config, dist, data_dir, manifest, tokenizer, network, plan, train_loader, val_loader,
                         engine, ema, engine_model(engine), bound, init_from,
                         training_flops_per_token(config, network, manifest.seq_len),
                         peak_flops(dist.device))


def training_flops_per_token(config: Config, network: TransformerConfig, seq_len: int) -> float:
    """The FLOPs per token of a training step, by the MFU convention (pipeline.training.throughput):
    what MFU divides by and what a sweep's budgets count (orchestration.sweep)."""
    block_size = config.model.block_size
    return (flops_per_token(network, seq_len) if block_size is None else
            block_diffusion_flops_per_token(network, seq_len, block_size))


def _loaders(config: Config, data_dir: str | Path, dist: Distributed, plan: TrainingPlan,
             cache_dir: Path | None) -> tuple[StreamingLoader, StreamingLoader]:
    """``cache_dir``: where chunks read from object storage are kept (None: local data)."""
    cache = None
    if cache_dir is not None and config.data.cache_gb > 0:
        cache = ChunkCache(cache_dir / "chunks", int(config.data.cache_gb * GIB))
    common = {"rank": dist.rank, "world_size": dist.world_size, "cache": cache}
    micro_batch = plan.batches.micro_batch
    train = StreamingLoader(data_dir, config.data.train_split, micro_batch, seed=config.train.seed,
                            global_batch_size=plan.batches.global_batch, num_workers=config.data.num_workers,
                            shuffle_window=config.data.shuffle_window, pin_memory=dist.device.type == "cuda", **common)
    val = StreamingLoader(data_dir, config.data.val_split, config.eval.micro_batch_size or micro_batch,
                          seed=config.eval.seed, shuffle=False, **common)
    return train, val


def network_config(model: ModelSection, manifest: Manifest) -> TransformerConfig:
    """The transformer for ``model`` over the data's vocabulary and sequence length."""
    vocab, seq_len = manifest.tokenizer["vocab_size"], manifest.seq_len
    max_seq_len = model.max_seq_len or seq_len
    if max_seq_len < seq_len:
        raise UserError(f"config field model.max_seq_len = {max_seq_len} is shorter than the data's "
                        f"sequence length {seq_len} (manifest.json); raise it or leave it unset")
    if model.block_size is not None and seq_len % model.block_size:
        raise UserError(f"config field model.block_size = {model.block_size} does not divide the data's sequence "
                        f"length {seq_len} (manifest.json); choose a divisor of {seq_len}")
    if model.block_size is not None and max_seq_len % model.block_size:
        raise UserError(f"config field model.block_size = {model.block_size} does not divide model.max_seq_len = "
                        f"{max_seq_len}, the network's window (its blocks are scored and sampled whole); choose a "
                        f"divisor of both {seq_len} and {max_seq_len}, or leave model.max_seq_len unset")
    shape = {k: v for k, v in (("n_layers", model.n_layers), ("d_model", model.d_model),
                                ("n_heads", model.n_heads)) if v is not None}
    try:
        config = preset(model.preset, vocab, **shape)
        return replace(config, max_seq_len=max_seq_len, dropout=model.dropout,
                       time_conditioning=model.time_conditioning,
                       causal=model.objective == "autoregressive", vocab_multiple=model.vocab_multiple,
                       document_separator=manifest.tokenizer["eos_id"] if model.document_mask else None)
    except ValueError as err:
        raise UserError(f"config section model: {err}") from None


def check_masked_tokens(config: Config, seq_len: int) -> None:
    """Block diffusion's clipped masking rates (``train.block_mask_rate``) must mask at least one
    token per training sequence on average: below that most sequences have no masked token, add
    nothing to the loss, and the run learns next to nothing while its loss looks excellent."""
    beta, omega = config.train.block_mask_rate
    if config.model.block_size is None or (beta + omega) / 2 * seq_len >= 1:
        return
    raise UserError(f"config field train.block_mask_rate = {[beta, omega]}: masks (beta + omega) / 2 = "
                    f"{(beta + omega) / 2:.3g} of the tokens on average, {(beta + omega) / 2 * seq_len:.3g} of a "
                    f"sequence of {seq_len}, so most training sequences have no masked token to learn from; widen it "
                    f"to mask at least one per sequence (BD3-LM's clipped intervals are [0.3, 0.8] and [0.45, 0.95])")


def find_tokenizer(manifest: Manifest, data_dir: Path, location: str | None = None) -> Tokenizer:
    """The tokenizer the shards were made with: the prep keeps its files in the data
    directory's ``tokenizer/``, so a data directory trains wherever it is copied. Checked
    against the manifest's sha256 and vocabulary size. ``location``: the object store's URI
    when ``data_dir`` is its local copy (``localize_metadata``), which the errors name: the
    fix is there."""
    path, expected = data_dir / TOKENIZER_DIR, manifest.tokenizer["sha256"]
    source = f"{location.rstrip('/')}/{TOKENIZER_DIR}" if location else str(path)
    shards = (f"{location or data_dir}/manifest.json: the shards were made with tokenizer "
              f"{manifest.tokenizer.get('path')!r} (sha256 {expected[:12]}...)")
    if not path.exists():
        raise UserError(f"{shards}, not found at {source}; rerun that `unmask prep --out {location or data_dir}` "
                        f"where its tokenizer is (nothing is redone): the prep then keeps a copy in {source}")
    where = f"{source} (its copy in {path})" if location else source
    try:
        tokenizer = load_tokenizer(path)
    except UserError as err:
        found = f"{where} cannot be loaded ({err})"
    else:
        if tokenizer.sha256 == expected:
            _check_vocab_size(tokenizer, manifest, data_dir)
            return tokenizer
        found = (f"{where} holds another tokenizer (sha256 {tokenizer.sha256[:12]}..., {tokenizer.vocab_size} "
                 f"tokens; the manifest records {manifest.tokenizer.get('vocab_size')}): replaced since the prep")
    raise UserError(f"{shards}, but {found}. Put the tokenizer of the shards back in {source}, or prep the corpus "
                    f"again with the one there (into a new --out)")


def _check_vocab_size(tokenizer: Tokenizer, manifest: Manifest, data_dir: Path) -> None:
    """The manifest's vocabulary sizes the network: one that disagrees with the tokenizer the
    shards were made with (a hand-edited manifest) would fail at the first step, or worse,
    silently train a network too small or too large for the data."""
    recorded = manifest.tokenizer["vocab_size"]
    if recorded != tokenizer.vocab_size:
        raise UserError(f"{data_dir}/manifest.json: tokenizer.vocab_size is {recorded}, but the tokenizer the "
                        f"shards were made with ({tokenizer.path}) has {tokenizer.vocab_size} tokens; restore "
                        f"the manifest (or rerun `unmask prep`)")

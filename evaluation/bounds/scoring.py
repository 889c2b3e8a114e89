"""The scoring of an export on the zero-shot datasets: the bound on each, with the protocol that
produced it (the bounds of ``unmask eval``, before its samples and report).

    scores = score_datasets(exported, ScoringConfig(datasets=("ptb", "val"), data_dir="../shared/data",
                                                    shards="shards/"), device=torch.device("cpu"))
    scores.datasets["ptb"].perplexity_bound, scores.protocol.name

Each dataset is read and detokenized as its protocol says (``evaluation.bounds.protocols``),
tokenized with the model's own tokenizer, wrapped into blocks and scored by the estimator
(``evaluation.bounds.estimator``); bits per byte divide the total by the UTF-8 bytes of the
detokenized text. ``val`` is the val split of the training shards (their tokenizer must be the
export's; ours is the only protocol that reads it). With a ``suite`` the datasets are its sets
whose files are under ``data_dir`` (``evaluation.bounds.suites``). Every number carries the record of what was
read and how (``DatasetResult.dataset``) and ``Scores.protocol`` every setting, so it can be
reproduced; every rank returns the same scores. See docs/evaluation.md#the-protocol.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError
from common.progress import bar as progress_bar
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import is_remote, read_manifest
from evaluation.bounds.datasets import (
    DATASET_NAMES,
    EvalDataset,
    check_text_file,
    dataset_file,
    load_dataset,
    load_text_file,
)
from evaluation.bounds.detokenizers import DETOKENIZERS
from evaluation.bounds.estimator import (
    Blocks,
    BoundEstimate,
    autoregressive_nll,
    estimate_bound,
    per_time_contributions,
)
from evaluation.bounds.protocols import DEFAULT_PROTOCOL, PROTOCOLS, UNMASK, ZeroShotProtocol, get_protocol
from evaluation.bounds.suites import missing_sets, present_sets, suite_sets
from evaluation.inference import BLOCKS_UNCOMPILED, COMPILE_SETTINGS, inference_mode, should_compile
from evaluation.results import (
    ABSENT,
    Absent,
    DatasetResult,
    MissingDataset,
    PerTimeContributions,
    ProtocolRecord,
    SuiteRecord,
)
from model.autoregressive import Autoregressive
from model.process import DiffusionProcess
from model.transformer import TransformerConfig
from pipeline.interchange.export import Exported
from pipeline.training.engine import choose_inference_batch, device_memory_bytes

__all__ = ["VAL_DATASET", "Scores", "ScoringConfig", "check_datasets", "default_batch_size", "score_dataset",
           "score_datasets", "with_suite"]

VAL_DATASET = "val"
VAL_NEEDS_SHARDS = ("dataset 'val' needs --shards DIR (the training data of `unmask prep`; a run of `unmask run` "
                    "finds its own RUN/data)")
# Blocks whose per-time contributions are recorded for the report's plot (a second pass over
# them; the plot needs a few hundred points, not the whole set).
PER_T_BLOCKS = 256
# Blocks per forward with --batch-size unset: on CPU a batch that keeps two cores busy; on a
# GPU the largest power of two the memory estimate fits (pipeline.training.engine.choose_inference_batch),
# at most LARGEST_GPU_BATCH (beyond it a forward is long enough that nothing is left to gain).
CPU_BATCH_SIZE = 16
LARGEST_GPU_BATCH = 256
AUTOREGRESSIVE = "autoregressive"  # an export's objective (and estimator) when it is a causal model
AllReduce = Callable[[list[float]], list[float]]


@dataclass(frozen=True, kw_only=True)
class Scores:
    """What ``score_datasets`` measures: the bound on every dataset, and the protocol that made them."""

    datasets: dict[str, DatasetResult]
    protocol: ProtocolRecord


@dataclass(frozen=True)
class ScoringConfig:
    """The protocol of an evaluation (recorded verbatim in the results)."""

    datasets: tuple[str, ...] = ()    # empty with a suite: its sets under data_dir (with_suite)
    data_dir: str | None = None       # root of the standard files (../shared/data layout)
    shards: str | None = None         # training shards, for the "val" dataset
    split: str | None = None          # None: the protocol's (ours: test; MDLM's: per dataset)
    protocol: str = DEFAULT_PROTOCOL  # a PROTOCOLS key: "unmask" (ours), "mdlm", "bd3lm" or "duo"
    detokenizer: str | None = None    # a DETOKENIZERS key for every text dataset; None: the protocol's
    samples_per_block: int = 16       # K; the 95% interval is honest from about 16 (estimator docs)
    seed: int = 0
    seq_len: int | None = None        # None: the protocol's (ours: the model's max_seq_len)
    batch_size: int | None = None     # blocks per forward; None: sized to the device (CPU_BATCH_SIZE on CPU)
    compile: str = "auto"             # COMPILE_SETTINGS: auto compiles on GPU for long evaluations
    discrete_steps: int | None = None
    target_rel_error: float | None = None
    add_eos: bool = True
    max_documents: int | None = None  # quick looks; a truncated set is named as such
    # Each replicate scores a random subset of this many blocks (estimate_bound): the whole
    # set's bound with an honest, wider interval, at a cost that does not grow with the set.
    blocks_per_replicate: int | None = None
    suite: str | None = None          # a suites.SUITES key: the datasets are its sets (see datasets)

    def check(self, *, shards_pending: bool = False) -> None:
        """The flags, then every dataset (check_datasets); ``shards_pending``: see there."""
        checks = [("--samples", self.samples_per_block >= 1, "must be >= 1"),
                  ("--batch-size", self.batch_size is None or self.batch_size >= 1, "must be >= 1"),
                  ("--compile", self.compile in COMPILE_SETTINGS, f"must be one of {', '.join(COMPILE_SETTINGS)}"),
                  ("--seq-len", self.seq_len is None or self.seq_len >= 2, "must be >= 2"),
                  ("--discrete-steps", self.discrete_steps is None or self.discrete_steps >= 1, "must be >= 1"),
                  ("--target-rel-error", self.target_rel_error is None or 0 < self.target_rel_error < 1,
                   "must lie in (0, 1), e.g. 0.002"),
                  ("--max-documents", self.max_documents is None or self.max_documents >= 1, "must be >= 1"),
                  ("--blocks-per-replicate", self.blocks_per_replicate is None or self.blocks_per_replicate >= 1,
                   "must be >= 1"),
                  ("--blocks-per-replicate", self.blocks_per_replicate is None or self.samples_per_block >= 2,
                   "needs --samples >= 2 (its interval comes from the replicates)"),
                  ("--protocol", self.protocol in PROTOCOLS, f"must be one of {', '.join(PROTOCOLS)}"),
                  ("--detokenizer", self.detokenizer is None or self.detokenizer in DETOKENIZERS,
                   f"must be one of {', '.join(DETOKENIZERS)}")]
        for flag, ok, requirement in checks:
            if not ok:
                raise UserError(f"{flag} {requirement}")
        if not self.add_eos and get_protocol(self.protocol).framed:
            raise UserError(f"--no-eos contradicts --protocol {self.protocol}, which fixes where EOS goes (its "
                            f"code's own rule)")
        if self.suite is not None:
            _check_suite(self.suite, self.datasets)
        if not self.datasets:
            raise UserError(f"--datasets: name at least one of {', '.join(DATASET_NAMES + (VAL_DATASET,))} "
                            f"or a file path")
        check_datasets(self, shards_pending=shards_pending)


def with_suite(config: ScoringConfig) -> ScoringConfig:
    """``config`` with the datasets of its suite whose files are under its ``data_dir``
    (``suites.present_sets``); unchanged without a suite, or when its datasets are chosen."""
    if config.suite is None or config.datasets:
        return config
    return replace(config, datasets=present_sets(config.suite, config.data_dir, config.protocol, config.split))


def _check_suite(suite: str, datasets: tuple[str, ...]) -> None:
    """A known suite whose sets have been chosen (with_suite), and only from it."""
    members = suite_sets(suite)
    if not datasets:
        raise UserError(f"--suite {suite}: its sets are not chosen yet (evaluation.bounds.scoring.with_suite)")
    strangers = [name for name in datasets if name not in members]
    if strangers:
        raise UserError(f"--suite {suite} scores {', '.join(members)}; {', '.join(strangers)} is not one of them: "
                        f"give --datasets instead of --suite to choose the sets yourself")


def check_datasets(config: ScoringConfig, *, shards_pending: bool = False) -> None:
    """Every dataset of ``config`` names something that can be read: a known name whose file
    is under ``data_dir`` (and has ``split``), ``val`` with ``shards`` holding a manifest (not
    looked at when ``shards_pending``: `unmask run` makes them), or an existing file. Checked
    before any work, so that a typo in the last name does not throw away the first ones' results.
    One UserError lists every problem."""
    problems = []
    protocol = get_protocol(config.protocol)
    for name in config.datasets:
        try:
            if name == VAL_DATASET:
                if protocol is not UNMASK:
                    raise UserError(f"dataset 'val' (the training shards, packed as trained) has no "
                                    f"{protocol.name} reading: evaluate it with --protocol {UNMASK.name}")
                if config.shards is None:
                    raise UserError(VAL_NEEDS_SHARDS)
                if not shards_pending:
                    read_manifest(config.shards, "--shards")
            elif name in DATASET_NAMES:
                if config.data_dir is None:
                    raise UserError(f"dataset {name!r} needs --data-dir (the ../shared/data layout; see SOURCES.md)")
                dataset_file(name, Path(config.data_dir), protocol.reading(name, config.split).split)
            elif Path(name).suffix or Path(name).exists():
                check_text_file(Path(name), config.detokenizer or "identity")
            else:
                raise UserError(f"unknown dataset {name!r}: choose from "
                                f"{', '.join(DATASET_NAMES + (VAL_DATASET,))}, or give a .txt/.jsonl/.parquet "
                                f"file path")
        except UserError as err:
            problems.append(str(err))
    if problems:
        raise UserError(f"--datasets {','.join(config.datasets)}: " + "; and ".join(problems))


def _read_dataset(name: str, config: ScoringConfig, protocol: ZeroShotProtocol) -> EvalDataset:
    if name in DATASET_NAMES:
        if config.data_dir is None:
            raise UserError(f"dataset {name!r} needs --data-dir (the ../shared/data layout; see SOURCES.md)")
        reading = protocol.reading(name, config.split, config.detokenizer)
        dataset = load_dataset(name, Path(config.data_dir), reading.split, detokenizer=reading.detokenizer,
                               rows=reading.rows)
    elif Path(name).suffix or Path(name).exists():
        dataset = load_text_file(Path(name), detokenizer=config.detokenizer or "identity")
    else:
        raise UserError(f"unknown dataset {name!r}: choose from {', '.join(DATASET_NAMES + (VAL_DATASET,))}, "
                        f"or give a .txt/.jsonl/.parquet file path")
    if config.max_documents is not None:
        dataset = replace(dataset, documents=dataset.documents[: config.max_documents],
                          name=f"{dataset.name} (first {config.max_documents} documents)")
    return dataset


def _text_blocks(dataset: EvalDataset, exported: Exported, seq_len: int, config: ScoringConfig,
                 protocol: ZeroShotProtocol) -> tuple[Blocks, dict]:
    """The dataset's blocks under ``protocol``, and its record (what was read, how it was wrapped)."""
    tokenizer = exported.tokenizer
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    documents = tokenizer.encode_batch(dataset.documents)
    wrapped = protocol.wrap(documents, seq_len, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=pad,
                            add_eos=config.add_eos, autoregressive=exported.config["objective"] == AUTOREGRESSIVE)
    record = {**dataset.protocol(), "protocol": protocol.name}
    if protocol.framed:
        record["dropped_tokens"] = wrapped.dropped_tokens
    return wrapped.blocks, record


def _val_blocks(exported: Exported, shards: str | None) -> tuple[Blocks, int, dict]:
    """The val split of the training shards: (blocks, UTF-8 bytes, protocol record)."""
    if shards is None:
        raise UserError(VAL_NEEDS_SHARDS)
    manifest = read_manifest(shards, "--shards")
    if manifest.tokenizer.get("sha256") != exported.tokenizer.sha256:
        raise UserError(f"{shards}: its tokenizer (sha256 {str(manifest.tokenizer.get('sha256'))[:12]}...) differs "
                        f"from the model's ({exported.tokenizer.sha256[:12]}...): the bound would be meaningless")
    split = manifest.splits.get(VAL_DATASET)
    if split is None or split.sequences == 0:
        raise UserError(f"{shards} has no val split; prep with --val-fraction > 0")
    loader = StreamingLoader(shards, VAL_DATASET, 1, shuffle=False, drop_padded_tail=False)
    tokens = torch.cat(list(loader))
    positions = torch.ones_like(tokens, dtype=torch.bool)
    if split.padding_tokens:
        positions[-1, tokens.shape[1] - split.padding_tokens:] = False
    where = shards if is_remote(shards) else str(Path(shards).resolve())  # a URI is its own name
    record = {"name": VAL_DATASET, "split": VAL_DATASET, "path": where,
              "manifest_sha256": manifest.sha256(), "unit": "packed training sequences (EOS-separated)",
              "detokenizer": "none", "documents": split.documents, "utf8_bytes": split.utf8_bytes}
    return Blocks(tokens, positions), split.utf8_bytes, record


def score_dataset(name: str, exported: Exported, config: ScoringConfig, *, device: torch.device,
                     rank: int = 0, world_size: int = 1, all_reduce: AllReduce | None = None) -> DatasetResult:
    """The bound on one dataset (all ranks get the same one; only rank 0's has ``per_t``)."""
    protocol = get_protocol(config.protocol)
    seq_len = _seq_len(exported, config, protocol)
    if name == VAL_DATASET:
        blocks, utf8_bytes, record = _val_blocks(exported, config.shards)
    else:
        dataset = _read_dataset(name, config, protocol)
        blocks, record = _text_blocks(dataset, exported, seq_len, config, protocol)
        utf8_bytes = dataset.utf8_bytes
    network = exported.network.to(device)
    batch_size = config.batch_size or default_batch_size(network.config, seq_len, device)
    common = {"batch_size": batch_size, "device": device, "rank": rank, "world_size": world_size}
    # A block diffusion model is evaluated uncompiled: its compiled blocks with FlexAttention's
    # mask, then its KV-cache sampler, have not run on a GPU yet.
    if exported.spec.block_size is None and should_compile(config.compile, device,
                                                           _scored_tokens(blocks, config, world_size)):
        network.compile_parts()
    with inference_mode(network, device):
        return _estimate(record, blocks, utf8_bytes, exported, network, config, common, all_reduce)


def default_batch_size(network: TransformerConfig, seq_len: int, device: torch.device) -> int:
    """Blocks per forward when --batch-size is not given (``CPU_BATCH_SIZE``, ``LARGEST_GPU_BATCH``)."""
    if device.type != "cuda":
        return CPU_BATCH_SIZE
    return choose_inference_batch(network, seq_len, "bf16", device_memory_bytes(device), LARGEST_GPU_BATCH)


def _scored_tokens(blocks: Blocks, config: ScoringConfig, world_size: int) -> int:
    """Tokens one rank passes through the network: its blocks x length x time samples (at
    least; a target error may add samples)."""
    per_replicate = min(config.blocks_per_replicate or blocks.num_blocks, blocks.num_blocks)
    return math.ceil(per_replicate / world_size) * blocks.tokens.shape[1] * config.samples_per_block


def _scoring_bar(record: dict, blocks: Blocks, config: ScoringConfig, common: dict):
    """Rank 0's bar over the (time sample, block) pairs it scores: minutes per dataset on a
    CPU deserve a rate and an ETA. Unknown length with --target-rel-error (it adds samples)."""
    per_replicate = min(config.blocks_per_replicate or blocks.num_blocks, blocks.num_blocks)
    own = math.ceil(per_replicate / common["world_size"])
    total = None if config.target_rel_error else config.samples_per_block * own
    return progress_bar(total=total, desc=str(record.get("name", "eval")), unit="block",
                        disable=common["rank"] != 0)


def _seq_len(exported: Exported, config: ScoringConfig, protocol: ZeroShotProtocol) -> int:
    """The block length: --seq-len, else the protocol's, else the model's training length."""
    max_seq_len = exported.network.config.max_seq_len
    seq_len = config.seq_len or protocol.block_length or max_seq_len
    flag = f"--seq-len {seq_len}" if config.seq_len else f"--protocol {protocol.name} (blocks of {seq_len} tokens)"
    if seq_len > max_seq_len:
        raise UserError(f"{flag} exceeds the model's max_seq_len {max_seq_len}: give a --seq-len of at most "
                        f"{max_seq_len} (numbers at another length are not comparable with the papers')")
    block_size = exported.spec.block_size
    if block_size is not None and seq_len % block_size:
        raise UserError(f"{flag}: the model is a block diffusion over blocks of {block_size} tokens, which must "
                        f"divide the evaluation length; give a --seq-len that is a multiple of {block_size}")
    return seq_len


def _estimate(record: dict, blocks: Blocks, utf8_bytes: int, exported: Exported, network, config: ScoringConfig,
              common: dict, all_reduce: AllReduce | None) -> DatasetResult:
    rank = common["rank"]
    # The blocks hold ids of the export's own tokenizer: no value checks (each a host sync).
    process = exported.process(validate=False)
    if isinstance(process, Autoregressive):
        estimate = autoregressive_nll(process, network, blocks, all_reduce=all_reduce, **common)
        per_t = None
    else:
        with _scoring_bar(record, blocks, config, common) as bar:
            estimate = estimate_bound(process, network, blocks, samples_per_block=config.samples_per_block,
                                      seed=config.seed, discrete_steps=config.discrete_steps,
                                      target_rel_error=config.target_rel_error, all_reduce=all_reduce,
                                      blocks_per_replicate=config.blocks_per_replicate, progress=bar.update,
                                      **common)
        per_t = _per_t(process, network, blocks, config, common) if rank == 0 else None
    return _record(record, estimate, utf8_bytes, per_t)


def _per_t(diffusion: DiffusionProcess, network, blocks: Blocks, config: ScoringConfig,
           common: dict) -> PerTimeContributions:
    """Per-time contributions of the first PER_T_BLOCKS blocks, one time sample each (rank 0)."""
    count = min(blocks.num_blocks, PER_T_BLOCKS)
    subset = Blocks(blocks.tokens[:count], blocks.positions[:count])
    records = per_time_contributions(diffusion, network, subset, samples_per_block=1, seed=config.seed,
                                     **{**common, "rank": 0, "world_size": 1})
    return PerTimeContributions(t=records.t.tolist(), contribution=records.diffusion_per_token.tolist())


def _record(dataset: dict, estimate: BoundEstimate, utf8_bytes: int,
            per_t: PerTimeContributions | None) -> DatasetResult:
    result = DatasetResult(dataset=dataset, estimate=estimate.to_dict(), nelbo_per_token=estimate.nelbo_per_token,
                           standard_error=estimate.standard_error, perplexity_bound=estimate.perplexity_bound,
                           perplexity_interval=estimate.perplexity_interval(),
                           bits_per_byte=estimate.bits_per_byte(utf8_bytes), num_tokens=estimate.num_tokens,
                           per_t=ABSENT if per_t is None else per_t)
    if not math.isfinite(estimate.nelbo_per_token):
        raise UserError(f"the bound on {dataset['name']} is not finite: the export's weights are broken")
    return result


def score_datasets(exported: Exported, config: ScoringConfig, *, device: torch.device, rank: int = 0,
                   world_size: int = 1, all_reduce: AllReduce | None = None,
                   progress: Callable[[str], None] = lambda message: None) -> Scores:
    """The bound on every dataset of ``config`` (of its suite's sets under its data_dir), and the
    protocol that produced them."""
    config = with_suite(config)
    config.check()
    if config.compile == "on" and exported.spec.block_size is not None:
        raise UserError(f"--compile on: {BLOCKS_UNCOMPILED}; leave --compile auto or off")
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    datasets = {}
    for name in config.datasets:
        progress(f"evaluating {name}")
        datasets[name] = score_dataset(name, exported, config, device=device, rank=rank,
                                          world_size=world_size, all_reduce=all_reduce)
    return Scores(datasets=datasets, protocol=_protocol(exported, config, world_size))


def _bound_in_words(estimator: str, block_size: int | None) -> str:
    bound = ("continuous-time NELBO with both endpoint terms (reconstruction scored by the model)"
             if estimator == "continuous" else estimator)
    if block_size is None or estimator == "autoregressive":
        return bound
    return (f"block diffusion (blocks of {block_size} tokens): the sum over blocks of each block's {bound}, "
            "given the clean blocks before it, t in (0, 1] (no training-time clipping)")


def _protocol(exported: Exported, config: ScoringConfig, world_size: int) -> ProtocolRecord:
    objective = exported.config["objective"]
    estimator = AUTOREGRESSIVE if objective == AUTOREGRESSIVE else (
        "discrete" if config.discrete_steps else "continuous")
    protocol = get_protocol(config.protocol)
    return ProtocolRecord(
        name=protocol.name, seq_len=_seq_len(exported, config, protocol),
        samples_per_block=config.samples_per_block, seed=config.seed, estimator=estimator,
        discrete_steps=config.discrete_steps, target_rel_error=config.target_rel_error,
        add_eos=protocol.eos_per_unit if protocol.framed else config.add_eos,
        split=config.split or protocol.split_summary(config.datasets),
        max_documents=config.max_documents,
        blocks_per_replicate=config.blocks_per_replicate if config.blocks_per_replicate else ABSENT,
        wrapping=protocol.wrapping,
        bound=_bound_in_words(estimator, exported.spec.block_size),
        block_size=ABSENT if exported.spec.block_size is None else exported.spec.block_size,
        precision="bf16 autocast on GPU, float32 on CPU; log-softmax float32; sums float64",
        world_size=world_size, suite=_suite_record(config))


def _suite_record(config: ScoringConfig) -> SuiteRecord | Absent:
    """The suite the datasets came from, with its sets that were not under data_dir."""
    if config.suite is None:
        return ABSENT
    missing = missing_sets(config.suite, config.datasets, config.protocol, config.split)
    return SuiteRecord(name=config.suite, missing=tuple(MissingDataset(name=item.name, split=item.split,
                                                                       expected=item.expected) for item in missing))

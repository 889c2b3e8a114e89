"""The shard writer: raw corpora -> tokenized, packed WebDataset shards and a manifest.

``write_shards`` drives two stages, each recorded in a ledger so that a killed prep resumes
where it stopped (``data_prep.resume``): tokenize (``data_prep.tokenize_stage``: each work
unit of ``data_prep.readers`` encoded, EOS appended, each document assigned to train or val)
and shards (``data_prep.shard_stage``: every shard cut from the units' token streams and
written independently). One worker runs in this process, more as Ray actors and tasks.

Invariants: the shards and manifest depend only on the inputs, the tokenizer and the
``PrepConfig``, never on the number of workers or where a previous run was killed; a split
holds exactly the sum over its documents of (tokens + 1 EOS), its last sequence padded and
the padding counted; the tokenizer's files are kept in ``DIR/tokenizer``, which the manifest
names; ``manifest.json`` is written last. The output directory is claimed as a prep's
(``PREP_KIND``). The manual: docs/data-preparation.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from common.atomic_files import remove_temporaries
from common.errors import UserError
from common.outputs import InputPath, OutputKind, check_output_dir, claim_output_dir, staged_directory
from common.progress import bar as progress_bar
from common.ray_runtime import ray_session
from data_prep.ledger import Ledger
from data_prep.readers import (
    BINARY_FIX,
    DEFAULT_UNIT_BYTES,
    InputFile,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    local_roots,
    plan_units,
    resolve_inputs,
    skipped_as_binary,
)
from data_prep.resume import WORK_DIR, start_or_resume
from data_prep.shard_stage import SplitLayout, plan_shards, shard_key, write_one_shard
from data_prep.shards.format import (
    FORMAT_VERSION,
    SPLITS,
    TOKENIZER_DIR,
    Manifest,
    ShardInfo,
    SplitInfo,
    chunk_rows,
    token_dtype,
)
from data_prep.tokenize_stage import UnitTokenizer, unit_key
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.load import load_tokenizer

# Target size of a shard: large enough that a cluster streams few files, small enough that
# every rank of a large job gets several (the loader balances at sequence granularity).
DEFAULT_SHARD_BYTES = 128 << 20
# Held-out share of documents: 0.5% of OpenWebText is ~40k documents, plenty for a bound.
DEFAULT_VAL_FRACTION = 0.005
# The read flags that decide what happens to bad input, not what good input is, with the
# Attention's memory and time grow with the square of the length, and every preset is far
# below it (medium: 1024); above it, --seq-len is a typo (1000000000 would pack a 2 GB shard of
# padding out of 30 KB of text). Raise it here for a model that truly needs more.
MAX_SEQ_LEN = 1 << 17
# Documents repaired or skipped beyond this share of those read are more than stray bytes:
# the input is likely in another encoding, or the flag drops most of it.
LOUD_SHARE = 0.01
# A split whose padding exceeds this share of its token slots is mostly padding: --seq-len is
# long for the corpus.
PADDING_WARN_SHARE = 0.5


# What `unmask prep --out` (and `unmask run`'s RUN/data) holds: shards, manifest, tokenizer.
PREP_KIND = OutputKind("prep", "the shards of `unmask prep`", whole=False)


@dataclass(frozen=True)
class PrepConfig:
    """Everything that determines the shards (workers and Ray address do not)."""

    inputs: tuple[str, ...]
    seq_len: int
    val_fraction: float = DEFAULT_VAL_FRACTION
    seed: int = 0
    read: ReadOptions = field(default_factory=ReadOptions)
    shard_bytes: int = DEFAULT_SHARD_BYTES
    unit_bytes: int = DEFAULT_UNIT_BYTES

    def __post_init__(self) -> None:
        if not self.inputs:
            raise UserError("--input: give at least one file, directory or glob")
        if not 2 <= self.seq_len <= MAX_SEQ_LEN:
            raise UserError(f"--seq-len must lie in [2, {MAX_SEQ_LEN}] (data_prep.write_shards.MAX_SEQ_LEN: the "
                            f"longest sequence unmask packs), got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")
        if self.shard_bytes < 1 or self.unit_bytes < 1:
            raise UserError("--shard-bytes and --unit-bytes must be positive")


@dataclass
class PrepResult:
    manifest: Manifest
    nothing_to_do: bool
    units_resumed: int       # units found finished in the ledger at the start
    units_run: int
    shards_resumed: int
    shards_written: int
    tokens_run: int          # tokens produced by the units this run tokenized
    seconds: float
    tokenize_seconds: float = 0.0   # stage 1 alone (Ray startup and planning excluded)
    worker_seconds: float = 0.0     # stage 1 busy time summed over workers
    policy_change: str = ""         # what a changed --bad-utf8 / --bad-json made this run redo

    def warnings(self) -> list[str]:
        """What the user must know about the inputs and the shards: the files skipped as
        binary, documents repaired or skipped beyond ``LOUD_SHARE`` of those read, splits
        that are mostly padding."""
        skipped = [entry for entry in self.manifest.inputs if entry.get("skipped")]
        lines = [] if not skipped else [
            f"skipped {len(skipped)} input file(s) as binary (manifest.json: counts.binary_files_skipped); "
            f"{BINARY_FIX}:",
            *(f"  {entry['uri']}: {entry['skipped']}" for entry in skipped)]
        counts = self.manifest.counts
        read = _documents_read(counts)
        for affected, what in _affected_documents(counts):
            if affected > LOUD_SHARE * read:
                lines.append(f"{affected / read:.1%} of the documents ({affected:,} of {read:,}) {what}")
        return lines + _padding_warnings(self.manifest)

    def notes(self) -> list[str]:
        """The documents repaired or skipped, counted, with the flag that changes each, when
        they stay within ``LOUD_SHARE`` of those read (``warnings`` names the others)."""
        counts = self.manifest.counts
        read = _documents_read(counts)
        return [f"{affected:,} of {read:,} documents {what}" for affected, what in _affected_documents(counts)
                if 0 < affected <= LOUD_SHARE * read]

    def summary(self) -> str:
        splits = self.manifest.splits
        docs = sum(s.documents for s in splits.values())
        tokens = sum(s.tokens for s in splits.values())
        text_bytes = sum(s.utf8_bytes for s in splits.values())
        shards = sum(len(s.shards) for s in splits.values())
        if self.nothing_to_do:
            return (f"nothing to do: the shards match this config ({docs:,} documents, {tokens:,} tokens, "
                    f"{shards} shards)")
        rate = self.tokens_run / self.tokenize_seconds if self.tokenize_seconds > 0 else 0.0
        resumed = (f"; resumed {self.units_resumed} units and {self.shards_resumed} shards"
                   if self.units_resumed or self.shards_resumed else "")
        if self.policy_change:
            resumed += f"; {self.policy_change}"
        return (f"{docs:,} documents, {tokens:,} tokens, {text_bytes:,} bytes of text -> {shards} shards "
                f"(train {splits['train'].sequences:,} / val {splits['val'].sequences:,} sequences) in "
                f"{self.seconds:.1f} s, tokenizing at {rate:,.0f} tokens/s{resumed}")


def _documents_read(counts: dict) -> int:
    """The documents the readers met, kept or not (the denominator of the shares above)."""
    return sum(counts.get(name, 0) for name in ("documents", "empty_skipped", "bad_utf8_skipped", "bad_json_skipped"))


def _affected_documents(counts: dict) -> list[tuple[int, str]]:
    """(count, what happened to them and the flag that changes it) of each nonzero policy."""
    fix = "; if the input is in another encoding (Latin-1, say), convert it: iconv -f LATIN1 -t UTF-8 IN > OUT"
    described = [
        (counts.get("bad_utf8_repaired", 0), "held invalid UTF-8, repaired with U+FFFD (--bad-utf8 replace; "
                                             f"--bad-utf8 skip leaves them out){fix}"),
        (counts.get("bad_utf8_skipped", 0), "held invalid UTF-8 and were left out (--bad-utf8 skip; --bad-utf8 "
                                            f"replace keeps them, repaired with U+FFFD){fix}"),
        (counts.get("bad_json_skipped", 0), "were JSONL lines that are not JSON or lack the text field, left out "
                                            "(--bad-json skip; --bad-json error stops at the first)"),
    ]
    return [(count, what) for count, what in described if count]


def _padding_warnings(manifest: Manifest) -> list[str]:
    lines = []
    for name, split in manifest.splits.items():
        slots = split.sequences * manifest.seq_len
        if split.documents and split.padding_tokens > PADDING_WARN_SHARE * slots:
            lines.append(f"split {name}: {split.padding_tokens:,} of its {slots:,} token slots "
                         f"({split.padding_tokens / slots:.0%}) are padding: --seq-len {manifest.seq_len} is long for "
                         f"its {split.tokens:,} tokens; lower --seq-len, or give more text")
    return lines


def _identity(config: PrepConfig, tokenizer: Tokenizer, files: Sequence[InputFile]) -> dict:
    identity = {"format_version": FORMAT_VERSION, "config": asdict(config),
                "tokenizer_sha256": tokenizer.sha256,
                "inputs": [{"uri": f.uri, "size": f.size} for f in files]}
    identity["config"]["inputs"] = list(config.inputs)
    identity["sha256"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return identity




def _run_stage(rows: Iterable[dict], description: str, total: int, progress: bool) -> tuple[int, float]:
    """Drive a stage's rows to completion with a progress bar.

    Returns the sums of the rows' ``tokens`` and ``seconds`` (worker busy time) where
    present. Workers report a user's mistake in an ``error`` column; the first one stops
    the prep (finished items stay in the ledger, so nothing done is lost)."""
    tokens, busy = 0, 0.0
    start = time.perf_counter()
    with progress_bar(total=total, desc=description, unit="item", disable=not progress) as bar:
        for row in rows:
            if row["error"]:
                raise UserError(row["error"])
            bar.update(1)
            if "tokens" in row:
                tokens, busy = tokens + int(row["tokens"]), busy + float(row["seconds"])
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):,.0f} tokens/s")
    return tokens, busy


def _runs_in_process(workers: int, ray_address: str | None) -> bool:
    """Whether the prep runs in this process, without Ray: one worker on no named cluster.
    Ray's start-up (a local instance, an actor that imports Ray Data, a task pool, the
    shutdown: 6 to 9 s of a one-worker prep on two cores) buys one worker nothing, and the
    output is the same either way (it never depends on the workers)."""
    return workers == 1 and ray_address is None


@contextlib.contextmanager
def _ray_data(ray_address: str | None, workers: int) -> Iterator[None]:
    """A Ray session (``ray_session``) with Ray Data quiet."""
    with ray_session(ray_address, num_cpus=workers + 1 if ray_address is None else None):
        import ray.data

        # Ray Data logs its plan and progress on every run; the console is for our own
        # progress bar and summary (set after the import, which configures its loggers).
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        # Our own bar replaces Ray Data's; Ray says so at WARNING, which is no news to the user.
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield


def _tokenize_rows(pending_units: list[int], workers: int, actor_args: tuple) -> Iterable[dict]:
    """The rows of stage 1 on Ray: each pending unit tokenized by one of ``workers`` actors."""
    import ray.data

    with warnings.catch_warnings():
        # max_restarts has no named parameter yet in this Ray; the catch-all is deprecated.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated", category=Warning)
        return ray.data.from_items([{"index": i} for i in pending_units]).map_batches(
            UnitTokenizer, batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1,
            fn_constructor_args=actor_args,
            # No actor restarts: a dead actor fails the stage, and a rerun resumes from the ledger.
            # Restartable actors built from arguments in the object store (Ray Data keeps the
            # UDF there) make Ray's core worker print an error line on every prep.
            max_restarts=0).iter_rows()


def _shard_rows(in_process: bool, pending_shards: list[dict], workers: int, shard_args: dict) -> Iterable[dict]:
    """The rows of stage 2: each pending shard written, here or by ``workers`` Ray tasks."""
    if in_process:
        return (write_one_shard(row, **shard_args) for row in pending_shards)
    import ray.data

    return ray.data.from_items(pending_shards).map(
        write_one_shard, compute=ray.data.TaskPoolStrategy(size=workers), num_cpus=1,
        fn_kwargs=shard_args).iter_rows()


@dataclass(frozen=True)
class PrepRun:
    """How a prep runs (none of it changes the shards): ``write_shards``'s keyword arguments."""

    workers: int
    ray_address: str | None
    overwrite: bool
    progress: bool
    tokenizer_follows_inputs: bool


def _inputs_of(config: PrepConfig, tokenizer: Tokenizer, out: Path) -> list[InputPath]:
    """What the prep reads, which its output must keep clear of: the corpus, and the tokenizer
    unless it is the prep's own copy (``DIR/tokenizer``, given back as --tokenizer)."""
    inputs = [InputPath(root, "--input") for root in local_roots(config.inputs)]
    own = (out / TOKENIZER_DIR).resolve()
    if tokenizer.path and not Path(tokenizer.path).resolve().is_relative_to(own):
        inputs.append(InputPath(tokenizer.path, "--tokenizer"))
    return inputs


def write_shards(config: PrepConfig, tokenizer: Tokenizer, out_dir: str | Path, *, workers: int = 1,
                 ray_address: str | None = None, overwrite: bool = False, progress: bool = True,
                 tokenizer_follows_inputs: bool = False) -> PrepResult:
    """Run (or resume, or skip) a prep with ``tokenizer``; see the module docstring. One worker without
    ``ray_address`` runs in this process (``_runs_in_process``), more in Ray.
    ``tokenizer_follows_inputs``: the tokenizer was trained from these inputs and read flags
    (``unmask prep --vocab-size``), so a change of --bad-utf8 / --bad-json may have changed it too.
    A prep that fails before any unit was tokenized leaves no trace of itself in ``out_dir``."""
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    started = time.perf_counter()
    out, inputs = Path(out_dir), _inputs_of(config, tokenizer, Path(out_dir))
    check_output_dir(out, PREP_KIND, "--out", inputs)
    files = resolve_inputs(config.inputs)
    with _claimed(out, inputs):
        return _run(config, tokenizer, out, files, started, PrepRun(workers, ray_address, overwrite, progress,
                                                                    tokenizer_follows_inputs))


@contextlib.contextmanager
def _claimed(out: Path, inputs: list[InputPath]) -> Iterator[None]:
    """``out`` claimed as a prep's for the block; a failure before any unit was tokenized
    leaves no trace of the prep there (its work, its marker, the directory it made)."""
    claim = claim_output_dir(out, PREP_KIND, "--out", inputs)
    try:
        yield
    except BaseException:
        ledger = out / WORK_DIR / "ledger"
        if not (ledger.is_dir() and any(ledger.iterdir())):
            shutil.rmtree(out / WORK_DIR, ignore_errors=True)
        claim.abandon()
        raise


def _run(config: PrepConfig, tokenizer: Tokenizer, out: Path, files: list[InputFile], started: float,
         run: PrepRun) -> PrepResult:
    identity = _identity(config, tokenizer, files)
    finished, policy_change = start_or_resume(out, identity, run.overwrite, run.tokenizer_follows_inputs)
    if finished is not None:
        _keep_tokenizer(tokenizer, out / TOKENIZER_DIR)  # put back if it was removed since
        return PrepResult(finished, True, 0, 0, 0, 0, 0, time.perf_counter() - started)
    work = out / WORK_DIR
    ledger = Ledger(work / "ledger")
    units = plan_units(files, config.read, config.unit_bytes)
    pending_units = [u.index for u in units if not ledger.done(unit_key(u.index))]
    dtype = token_dtype(tokenizer.vocab_size)
    workers, progress = run.workers, run.progress
    in_process = _runs_in_process(workers, run.ray_address)
    with contextlib.nullcontext() if in_process else _ray_data(run.ray_address, workers):
        tokens_run, busy, tokenize_started = 0, 0.0, time.perf_counter()
        if pending_units:
            actor_args = (tokenizer, units, config.read, config.seed, config.val_fraction, str(work))
            if in_process:
                rows = map(UnitTokenizer(*actor_args).tokenize, pending_units)
            else:
                rows = _tokenize_rows(pending_units, min(workers, len(pending_units)), actor_args)
            tokens_run, busy = _run_stage(rows, "tokenize", len(pending_units), progress)
        tokenize_seconds = time.perf_counter() - tokenize_started
        _refuse_an_empty_corpus(config, ledger, units, out)
        layouts = _layouts(ledger, units, config.seq_len, tokenizer)
        rows_per_chunk = chunk_rows(config.seq_len, dtype)
        per_shard = max(rows_per_chunk,
                        config.shard_bytes // (config.seq_len * dtype.itemsize) // rows_per_chunk * rows_per_chunk)
        shards = [row for layout in layouts.values() for row in plan_shards(layout, per_shard)]
        pending_shards = [r for r in shards if not ledger.done(shard_key(r["split"], r["index"]))]
        if pending_shards:
            shard_args = {"layouts": layouts, "work": str(work), "out": str(out), "dtype": dtype,
                          "rows_per_chunk": rows_per_chunk}
            _run_stage(_shard_rows(in_process, pending_shards, workers, shard_args), "shards",
                       len(pending_shards), progress)
    for split in SPLITS:  # every writer has finished: what killed ones left is garbage
        remove_temporaries(out / split)
    _keep_tokenizer(tokenizer, out / TOKENIZER_DIR)
    manifest = _assemble_manifest(config, tokenizer, identity, ledger, units, layouts, shards, rows_per_chunk)
    manifest.write(out)
    shutil.rmtree(work)
    return PrepResult(manifest, False, len(units) - len(pending_units), len(pending_units),
                      len(shards) - len(pending_shards), len(pending_shards), tokens_run,
                      time.perf_counter() - started, tokenize_seconds, busy, policy_change)


def _keep_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """The tokenizer's files in ``directory`` (DIR/tokenizer, which the manifest names), unless
    they are there already: training and export find them there wherever the data directory
    is copied, and a tokenizer given roles by flags (--eos-token) is only complete there."""
    try:
        if load_tokenizer(directory).sha256 == tokenizer.sha256:
            return
    except UserError:  # absent, or not a tokenizer
        pass
    with staged_directory(directory) as staging:
        tokenizer.save(staging)


def _read_counters(ledger: Ledger, units: Sequence[WorkUnit]) -> ReadCounters:
    counters = ReadCounters()
    for unit in units:
        counters = counters + ReadCounters(**ledger.get(unit_key(unit.index))["counters"])
    return counters


def _refuse_an_empty_corpus(config: PrepConfig, ledger: Ledger, units: Sequence[WorkUnit], out: Path) -> None:
    """Stop a prep whose inputs hold no document: shards of nothing train nothing. The work,
    which holds nothing, goes (and the output directory with it, when the prep made it)."""
    counters = _read_counters(ledger, units)
    if counters.documents:
        return
    dropped = [(counters.empty_skipped, "empty"),
               (counters.bad_utf8_skipped, "skipped for invalid UTF-8 (--bad-utf8 skip)"),
               (counters.bad_json_skipped, "skipped as broken JSONL lines (--bad-json skip)")]
    read = ", ".join(f"{count:,} {what}" for count, what in dropped if count) or "none found"
    binary = [(entry["binary_file"]["uri"], entry["binary_file"]["reason"])
              for entry in (ledger.get(unit_key(unit.index)) for unit in units) if "binary_file" in entry]
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    fix = (skipped_as_binary(binary) if binary and read == "none found" else
           "check the files, --text-format, --text-field or --text-column, and --bad-utf8")
    raise UserError(f"--input {' '.join(config.inputs)}: no documents to prepare (documents: {read}); {fix}")


def _pad_id(tokenizer: Tokenizer) -> int:
    return tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id


def _layouts(ledger: Ledger, units: Sequence[WorkUnit], seq_len: int, tokenizer: Tokenizer,
             ) -> dict[str, SplitLayout]:
    entries = [ledger.get(unit_key(u.index)) for u in units]
    layouts = {}
    for split in SPLITS:
        counts = [e["splits"][split]["tokens"] for e in entries]
        layouts[split] = SplitLayout(split, [u.index for u in units],
                                      [0, *itertools.accumulate(counts)], seq_len, _pad_id(tokenizer))
    return layouts


def _assemble_manifest(config: PrepConfig, tokenizer: Tokenizer, identity: dict, ledger: Ledger,
                       units: Sequence[WorkUnit], layouts: dict[str, SplitLayout], shards: list[dict],
                       rows_per_chunk: int) -> Manifest:
    entries = [ledger.get(unit_key(u.index)) for u in units]
    counters = _read_counters(ledger, units)
    splits = {}
    for split, layout in layouts.items():
        infos = [ShardInfo.from_dict(ledger.get(shard_key(split, r["index"]))) for r in shards if r["split"] == split]
        splits[split] = SplitInfo(
            documents=sum(e["splits"][split]["documents"] for e in entries), tokens=layout.tokens,
            utf8_bytes=sum(e["splits"][split]["utf8_bytes"] for e in entries),
            sequences=layout.sequences, padding_tokens=layout.sequences * layout.seq_len - layout.tokens,
            shards=infos)
    binary = {entry["binary_file"]["uri"]: entry["binary_file"]["reason"] for entry in entries
              if "binary_file" in entry}
    inputs = [{**item, "skipped": binary[item["uri"]]} if item["uri"] in binary else item
              for item in identity["inputs"]]
    return Manifest(
        format_version=FORMAT_VERSION, tokenizer={**tokenizer.describe(), "path": TOKENIZER_DIR},
        seq_len=config.seq_len,
        dtype=token_dtype(tokenizer.vocab_size).str, chunk_rows=rows_per_chunk, pad_id=_pad_id(tokenizer),
        prep_config=identity["config"], prep_config_sha256=identity["sha256"], inputs=inputs,
        counts=counters.to_dict(), splits=splits)

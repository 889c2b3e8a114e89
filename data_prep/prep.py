"""``unmask prep``: raw corpora -> tokenized, packed WebDataset shards and a manifest.

Two Ray Data stages, each recorded in a ledger so that a killed prep resumes where it stopped:

1. tokenize: work units (byte ranges of text, row groups of Parquet; ``data_prep.readers``)
   go to actors that hold the tokenizer. Each actor reads its unit, encodes every document,
   appends EOS, assigns the document to train or val by a keyed hash of its content, and
   writes the unit's token stream per split to ``.prep-work/units``.
2. shards: the corpus order is the order of the units, so once every unit is done the token
   offset of each unit is known and every shard (a fixed range of sequences) can be cut and
   written independently, in parallel: ``DIR/{train,val}/shard-NNNNNN.tar``.

The shards therefore depend only on the inputs, the tokenizer and the config, never on the
number of workers or on where a previous run was killed. Each split's token count is
exactly the sum over its documents of (tokens + 1 EOS); its last sequence is padded with
the tokenizer's pad id (EOS when it has none) and the padding is counted in the manifest.
Finally ``manifest.json`` is written (atomically) and the work directory removed.

A rerun of an unfinished prep that changes only --bad-utf8 / --bad-json (say, after one that
stopped on a broken JSONL line) goes on without --overwrite: the units whose counters show no
document the change acts on are kept, the others redone (``_resume_with_policy``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from common.atomic_files import atomic_write_bytes
from common.errors import UserError, output_dir
from common.ray_runtime import ray_session
from data_prep.ledger import Ledger
from data_prep.readers import (
    DEFAULT_UNIT_BYTES,
    InputFile,
    Piece,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    binary_reason,
    plan_units,
    read_unit,
    resolve_inputs,
)
from data_prep.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    Manifest,
    ShardInfo,
    SplitInfo,
    chunk_rows,
    shard_path,
    token_dtype,
    write_shard,
)
from data_prep.tokenizer import Tokenizer

WORK_DIR = ".prep-work"
IDENTITY_NAME = "identity.json"
# Target size of a shard: large enough that a cluster streams few files, small enough that
# every rank of a large job gets several (the loader balances at sequence granularity).
DEFAULT_SHARD_BYTES = 128 << 20
# Held-out share of documents: 0.5% of OpenWebText is ~40k documents, plenty for a bound.
DEFAULT_VAL_FRACTION = 0.005
# Pieces per tokenizer call: amortizes the per-call cost of the native batch encoder.
ENCODE_BATCH_PIECES = 256
HASH_SPACE = float(1 << 64)
# The read flags that decide what happens to bad input, not what good input is, with the
# counters of the documents each one acts on. A prep that stopped unfinished may go on with
# other values of them: only the units whose counters show such documents are redone.
POLICY_COUNTERS = {"bad_utf8": ("bad_utf8_repaired", "bad_utf8_skipped"),
                   "bad_json": ("bad_json_skipped",)}


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
        if self.seq_len < 2:
            raise UserError(f"--seq-len must be >= 2, got {self.seq_len}")
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
        """What the user should know about the inputs: the files skipped as binary."""
        skipped = [entry for entry in self.manifest.inputs if entry.get("skipped")]
        if not skipped:
            return []
        return [f"skipped {len(skipped)} input file(s) as binary (manifest.json: counts.binary_files_skipped"
                f"); leave them out, or convert UTF-16 text to UTF-8 (iconv -f UTF-16 -t UTF-8 IN > OUT.txt):",
                *(f"  {entry['uri']}: {entry['skipped']}" for entry in skipped)]

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


# ------------------------------------------------------------------------- stage 1
class _SplitRule:
    """Train or val by a keyed hash of the document's first piece: duplicates share a split."""

    def __init__(self, seed: int, val_fraction: float) -> None:
        # The keyed state, copied per document: cheaper than keying a new hash each time.
        self._keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))
        self.threshold = val_fraction * HASH_SPACE

    def split(self, data: bytes) -> str:
        """The split of the document whose first piece has the UTF-8 bytes ``data``."""
        digest = self._keyed.copy()
        digest.update(data)
        return "val" if int.from_bytes(digest.digest(), "little") < self.threshold else "train"


class _UnitOutput:
    """A unit's token stream and per-document (tokens, bytes) table for one split."""

    def __init__(self, prefix: Path, split: str, dtype: np.dtype) -> None:
        self.tokens_path = prefix.with_name(f"{prefix.name}.{split}.tokens")
        self.docs_path = prefix.with_name(f"{prefix.name}.{split}.docs.npy")
        self._tmp = self.tokens_path.with_name(self.tokens_path.name + ".tmp")
        self._handle = open(self._tmp, "wb")
        self.dtype = dtype
        self.docs: list[tuple[int, int]] = []
        self.pending: list[list[int]] = []  # the ids of the pieces of this batch, in order
        self.tokens = 0

    def flush(self) -> None:
        """Write the pending ids."""
        count = sum(map(len, self.pending))
        array = np.fromiter(itertools.chain.from_iterable(self.pending), dtype=self.dtype, count=count)
        self._handle.write(array.tobytes())
        self.tokens += count
        self.pending.clear()

    def close(self) -> None:
        self._handle.close()
        self._tmp.replace(self.tokens_path)
        table = np.array(self.docs, dtype=np.int64).reshape(-1, 2)
        tmp = self.docs_path.with_name(self.docs_path.name + ".tmp.npy")
        np.save(tmp, table)
        tmp.replace(self.docs_path)


def _batched(pieces: Iterable[Piece], size: int) -> Iterator[list[Piece]]:
    iterator = iter(pieces)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def tokenize_unit(unit: WorkUnit, tokenizer: Tokenizer, options: ReadOptions, rule: _SplitRule,
                  prefix: Path, dtype: np.dtype) -> dict:
    """Tokenize one unit into ``prefix.{split}.tokens``; return its ledger entry.

    The loop runs once per piece, and with short documents its own cost is of the order of the
    encoder's: each piece is turned into bytes once (for the split hash and the byte count)."""
    counters = ReadCounters()
    outputs = {split: _UnitOutput(prefix, split, dtype) for split in SPLITS}
    eos_id = tokenizer.eos_id
    output, doc_tokens, doc_bytes = outputs["train"], 0, 0
    for batch in _batched(read_unit(unit, options, counters), ENCODE_BATCH_PIECES):
        texts = [piece.text for piece in batch]
        for piece, text, ids in zip(batch, texts, tokenizer.encode_batch(texts)):
            data = text.encode("utf-8")
            if piece.first:
                output, doc_tokens, doc_bytes = outputs[rule.split(data)], 0, 0
            if piece.last:
                ids.append(eos_id)  # a fresh list from the encoder: extending it copies nothing
            output.pending.append(ids)
            doc_tokens += len(ids)
            doc_bytes += len(data)
            if piece.last:
                output.docs.append((doc_tokens, doc_bytes))
        for split_output in outputs.values():
            split_output.flush()
    for split_output in outputs.values():
        split_output.close()
    entry = {"index": unit.index, "counters": counters.to_dict(),
             "splits": {name: {"tokens": out.tokens, "documents": len(out.docs),
                               "utf8_bytes": int(sum(b for _, b in out.docs))}
                        for name, out in outputs.items()}}
    if counters.binary_files_skipped:
        entry["binary_file"] = {"uri": unit.file.uri, "reason": binary_reason(unit.file)}
    return entry


class _UnitTokenizer:
    """Holds the tokenizer and tokenizes the units it is handed: a Ray Data actor (``__call__``
    takes a batch of unit indices), or a plain object in a one-worker prep (``tokenize``)."""

    def __init__(self, tokenizer: Tokenizer, units: list[WorkUnit], config: PrepConfig, work: str) -> None:
        self.tokenizer, self.units, self.config = tokenizer, units, config
        self.work = Path(work)
        self.rule = _SplitRule(config.seed, config.val_fraction)
        self.ledger = Ledger(self.work / "ledger")
        self.dtype = token_dtype(tokenizer.vocab_size)

    def tokenize(self, index: int) -> dict:
        """Tokenize unit ``index`` and record it in the ledger. Returns its row: tokens, busy
        seconds, and the message of the user error that stopped it ("" if none)."""
        prefix = self.work / "units" / f"{index:06d}"
        started = time.perf_counter()
        try:
            entry = tokenize_unit(self.units[index], self.tokenizer, self.config.read, self.rule,
                                  prefix, self.dtype)
        except UserError as err:  # travels as data: Ray keeps only the text of exceptions
            entry, error = None, str(err)
        except OSError as err:  # e.g. a full disk
            entry, error = None, f"tokenizing {self.units[index].file.uri} into {prefix}: {err}"
        else:
            self.ledger.record(_unit_key(index), entry)
            error = ""
        tokens = sum(s["tokens"] for s in entry["splits"].values()) if entry else 0
        return {"index": index, "tokens": tokens, "seconds": time.perf_counter() - started, "error": error}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [self.tokenize(index) for index in batch["index"].tolist()]
        return {"index": batch["index"], "tokens": np.array([r["tokens"] for r in rows], dtype=np.int64),
                "seconds": np.array([r["seconds"] for r in rows]),
                "error": np.array([r["error"] for r in rows], dtype=object)}


def _unit_key(index: int) -> str:
    return f"unit-{index:06d}"


# ------------------------------------------------------------------------- stage 2
@dataclass(frozen=True)
class _SplitLayout:
    """Where each unit's tokens of one split start in the split's token stream."""

    split: str
    unit_indices: list[int]
    unit_offsets: list[int]      # cumulative, len(units) + 1
    seq_len: int
    pad_id: int

    @property
    def tokens(self) -> int:
        return self.unit_offsets[-1]

    @property
    def sequences(self) -> int:
        return math.ceil(self.tokens / self.seq_len)


def _shard_key(split: str, index: int) -> str:
    return f"shard-{split}-{index:06d}"


def _read_token_range(layout: _SplitLayout, work: Path, start: int, stop: int,
                      dtype: np.dtype) -> tuple[np.ndarray, int]:
    """Tokens [start, stop) of the split stream, and the UTF-8 bytes of the documents whose
    EOS lies in that range."""
    parts, text_bytes = [], 0
    for unit, lo, hi in zip(layout.unit_indices, layout.unit_offsets, layout.unit_offsets[1:]):
        if hi <= start or lo >= stop or hi == lo:
            continue
        prefix = work / "units" / f"{unit:06d}"
        tokens = np.memmap(prefix.with_name(f"{prefix.name}.{layout.split}.tokens"), dtype=dtype, mode="r")
        parts.append(np.asarray(tokens[max(start, lo) - lo:min(stop, hi) - lo]))
        docs = np.load(prefix.with_name(f"{prefix.name}.{layout.split}.docs.npy"))
        eos_at = lo + np.cumsum(docs[:, 0]) - 1
        text_bytes += int(docs[(eos_at >= start) & (eos_at < stop), 1].sum())
    return (np.concatenate(parts) if parts else np.empty(0, dtype)), text_bytes


def write_one_shard(row: dict, layouts: dict[str, _SplitLayout], work: str, out: str,
                    dtype: np.dtype, rows_per_chunk: int) -> dict:
    """Ray Data task: cut sequences [first, first + count) of a split into a shard."""
    layout = layouts[row["split"]]
    try:
        info = _cut_shard(layout, row["index"], row["first"], row["count"], Path(work), Path(out), dtype,
                          rows_per_chunk)
    except OSError as err:  # e.g. a full disk: travels as data (see _UnitTokenizer)
        return {**row, "error": f"writing {Path(out) / shard_path(layout.split, row['index'])}: {err}"}
    Ledger(Path(work) / "ledger").record(_shard_key(layout.split, row["index"]), asdict(info))
    return {**row, "error": ""}


def _cut_shard(layout: _SplitLayout, index: int, first: int, count: int, work: Path, out: Path,
               dtype: np.dtype, rows_per_chunk: int) -> ShardInfo:
    seq_len = layout.seq_len
    start, stop = first * seq_len, (first + count) * seq_len
    tokens, text_bytes = _read_token_range(layout, work, start, min(stop, layout.tokens), dtype)
    padding = stop - start - len(tokens)
    sequences = np.concatenate([tokens, np.full(padding, layout.pad_id, dtype)]).reshape(-1, seq_len)
    relative = shard_path(layout.split, index)
    digest = write_shard(out / relative, sequences, index, rows_per_chunk)
    return ShardInfo(path=relative, sequences=count, tokens=len(tokens), utf8_bytes=text_bytes,
                     sha256=digest, bytes=(out / relative).stat().st_size)


def _plan_shards(layout: _SplitLayout, sequences_per_shard: int) -> list[dict]:
    return [{"split": layout.split, "index": index, "first": first,
             "count": min(sequences_per_shard, layout.sequences - first)}
            for index, first in enumerate(range(0, layout.sequences, sequences_per_shard))]


# ------------------------------------------------------------------------- driver
def _identity(config: PrepConfig, tokenizer: Tokenizer, files: Sequence[InputFile]) -> dict:
    identity = {"format_version": FORMAT_VERSION, "config": asdict(config),
                "tokenizer_sha256": tokenizer.sha256,
                "inputs": [{"uri": f.uri, "size": f.size} for f in files]}
    identity["config"]["inputs"] = list(config.inputs)
    identity["sha256"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return identity


def _shards_intact(out: Path, manifest: Manifest) -> bool:
    return all((out / shard.path).is_file() and (out / shard.path).stat().st_size == shard.bytes
               for split in manifest.splits.values() for shard in split.shards)


def _policy_changes(old: dict, new: dict, tokenizer_follows: bool) -> dict[str, tuple[str, str]] | None:
    """The POLICY_COUNTERS flags whose values differ between two prep identities, as
    ``{name: (old, new)}``, when nothing else differs; None when anything else does. With
    ``tokenizer_follows`` (prep trained the tokenizer from these inputs and flags), the
    tokenizer may differ too."""
    def read(identity: dict) -> dict:
        config = identity.get("config")
        return config.get("read") or {} if isinstance(config, dict) else {}

    def rest(identity: dict) -> dict:
        identity = json.loads(json.dumps(identity))  # as identity.json holds it
        identity.pop("sha256", None)
        if tokenizer_follows:
            identity.pop("tokenizer_sha256", None)
        for name in POLICY_COUNTERS:
            read(identity).pop(name, None)
        return identity

    if not read(old) or rest(old) != rest(new):
        return None
    return {name: (read(old).get(name), read(new).get(name))
            for name in POLICY_COUNTERS if read(old).get(name) != read(new).get(name)}


def _resume_with_policy(out: Path, changes: dict[str, tuple[str, str]], new_tokenizer: bool) -> str:
    """Keep an unfinished prep's work that a change of the error-policy flags leaves as it is.

    A unit whose counters show no document that a changed flag acts on (no invalid UTF-8 for
    --bad-utf8, no broken JSONL line for --bad-json) reads the same under either value, so its
    tokens stand; the others are forgotten and tokenized again. When any is, the shards (cut
    from the units' tokens) are cut again too. The output is then the one an uninterrupted
    prep with the new flags writes. A tokenizer that the change retrained (``new_tokenizer``)
    changes every unit."""
    ledger = Ledger(out / WORK_DIR / "ledger")
    counters = [counter for name in changes for counter in POLICY_COUNTERS[name]]
    units = ledger.keys("unit-")
    redo = [key for key in units
            if new_tokenizer or any(ledger.get(key)["counters"].get(c, 0) for c in counters)]
    for key in redo:
        ledger.forget(key)
    if redo:
        for key in ledger.keys("shard-"):
            ledger.forget(key)
        for split in SPLITS:
            shutil.rmtree(out / split, ignore_errors=True)
    flags = ", ".join(f"--{name.replace('_', '-')} {old} -> {new}" for name, (old, new) in changes.items())
    retrained = ", which retrained the tokenizer" if new_tokenizer else ""
    return (f"{flags} since the unfinished prep{retrained}: kept {len(units) - len(redo)} of its "
            f"{len(units)} finished units, redid the {len(redo)} that the change affects")


def _prepare_output(out: Path, identity: dict, overwrite: bool,
                    tokenizer_follows: bool = False) -> tuple[Manifest | None, str]:
    """Return the finished manifest when it matches; refuse or clear a different prep. Unfinished
    work that differs only in --bad-utf8 / --bad-json goes on (_resume_with_policy); the second
    value says so ("" otherwise)."""
    work = out / WORK_DIR
    manifest_path, identity_path = out / MANIFEST_NAME, work / IDENTITY_NAME
    note = ""
    if manifest_path.is_file():
        manifest = Manifest.read(out)
        if manifest.prep_config_sha256 == identity["sha256"] and _shards_intact(out, manifest):
            return manifest, note
        what = "a different prep's manifest" if manifest.prep_config_sha256 != identity["sha256"] \
            else "a manifest whose shards are missing or damaged"
    elif identity_path.is_file() and (unfinished := json.loads(identity_path.read_text()))["sha256"] \
            != identity["sha256"]:
        changes = _policy_changes(unfinished, identity, tokenizer_follows)
        if changes:
            new_tokenizer = unfinished.get("tokenizer_sha256") != identity["tokenizer_sha256"]
            what, note = None, _resume_with_policy(out, changes, new_tokenizer)
        else:
            what = "unfinished work of a different prep"
    else:
        what = None
    if what is not None:
        if not overwrite:
            raise UserError(f"{out} holds {what}; pass --overwrite to replace it, or choose another --out")
        for name in (MANIFEST_NAME, WORK_DIR, *SPLITS):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    (work / "units").mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(identity_path, json.dumps(identity, sort_keys=True).encode())
    return None, note


def _run_stage(rows: Iterable[dict], description: str, total: int, progress: bool) -> tuple[int, float]:
    """Drive a stage's rows to completion with a progress bar.

    Returns the sums of the rows' ``tokens`` and ``seconds`` (worker busy time) where
    present. Workers report a user's mistake in an ``error`` column; the first one stops
    the prep (finished items stay in the ledger, so nothing done is lost)."""
    tokens, busy = 0, 0.0
    start = time.perf_counter()
    with tqdm(total=total, desc=description, unit="item", disable=not progress) as bar:
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
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield


def _tokenize_rows(in_process: bool, pending_units: list[int], workers: int,
                   actor_args: tuple) -> Iterable[dict]:
    """The rows of stage 1: each pending unit tokenized, here or by ``workers`` Ray actors."""
    if in_process:
        return map(_UnitTokenizer(*actor_args).tokenize, pending_units)
    import ray.data

    return ray.data.from_items([{"index": i} for i in pending_units]).map_batches(
        _UnitTokenizer, batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1,
        fn_constructor_args=actor_args).iter_rows()


def _shard_rows(in_process: bool, pending_shards: list[dict], workers: int, shard_args: dict) -> Iterable[dict]:
    """The rows of stage 2: each pending shard written, here or by ``workers`` Ray tasks."""
    if in_process:
        return (write_one_shard(row, **shard_args) for row in pending_shards)
    import ray.data

    return ray.data.from_items(pending_shards).map(
        write_one_shard, compute=ray.data.TaskPoolStrategy(size=workers), num_cpus=1,
        fn_kwargs=shard_args).iter_rows()


def prep(config: PrepConfig, tokenizer: Tokenizer, out_dir: str | Path, *, workers: int = 1,
         ray_address: str | None = None, overwrite: bool = False, progress: bool = True,
         tokenizer_follows_inputs: bool = False) -> PrepResult:
    """Run (or resume, or skip) a prep; see the module docstring. One worker without
    ``ray_address`` runs in this process (``_runs_in_process``), more in Ray.
    ``tokenizer_follows_inputs``: the tokenizer was trained from these inputs and read flags
    (``unmask prep --vocab-size``), so a change of --bad-utf8 / --bad-json may have changed it too."""
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    started = time.perf_counter()
    out = output_dir(out_dir, "--out")
    files = resolve_inputs(config.inputs)
    identity = _identity(config, tokenizer, files)
    finished, policy_change = _prepare_output(out, identity, overwrite, tokenizer_follows_inputs)
    if finished is not None:
        return PrepResult(finished, True, 0, 0, 0, 0, 0, time.perf_counter() - started)
    work = out / WORK_DIR
    ledger = Ledger(work / "ledger")
    units = plan_units(files, config.read, config.unit_bytes)
    pending_units = [u.index for u in units if not ledger.done(_unit_key(u.index))]
    dtype = token_dtype(tokenizer.vocab_size)
    in_process = _runs_in_process(workers, ray_address)
    with contextlib.nullcontext() if in_process else _ray_data(ray_address, workers):
        tokens_run, busy, tokenize_started = 0, 0.0, time.perf_counter()
        if pending_units:
            rows = _tokenize_rows(in_process, pending_units, workers, (tokenizer, units, config, str(work)))
            tokens_run, busy = _run_stage(rows, "tokenize", len(pending_units), progress)
        tokenize_seconds = time.perf_counter() - tokenize_started
        layouts = _layouts(ledger, units, config.seq_len, tokenizer)
        rows_per_chunk = chunk_rows(config.seq_len, dtype)
        per_shard = max(rows_per_chunk,
                        config.shard_bytes // (config.seq_len * dtype.itemsize) // rows_per_chunk * rows_per_chunk)
        shards = [row for layout in layouts.values() for row in _plan_shards(layout, per_shard)]
        pending_shards = [r for r in shards if not ledger.done(_shard_key(r["split"], r["index"]))]
        if pending_shards:
            shard_args = {"layouts": layouts, "work": str(work), "out": str(out), "dtype": dtype,
                          "rows_per_chunk": rows_per_chunk}
            _run_stage(_shard_rows(in_process, pending_shards, workers, shard_args), "shards",
                       len(pending_shards), progress)
    manifest = _assemble_manifest(config, tokenizer, identity, ledger, units, layouts, shards, rows_per_chunk)
    manifest.write(out)
    shutil.rmtree(work)
    return PrepResult(manifest, False, len(units) - len(pending_units), len(pending_units),
                      len(shards) - len(pending_shards), len(pending_shards), tokens_run,
                      time.perf_counter() - started, tokenize_seconds, busy, policy_change)


def _pad_id(tokenizer: Tokenizer) -> int:
    return tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id


def _layouts(ledger: Ledger, units: Sequence[WorkUnit], seq_len: int, tokenizer: Tokenizer,
             ) -> dict[str, _SplitLayout]:
    entries = [ledger.get(_unit_key(u.index)) for u in units]
    layouts = {}
    for split in SPLITS:
        counts = [e["splits"][split]["tokens"] for e in entries]
        layouts[split] = _SplitLayout(split, [u.index for u in units],
                                      [0, *itertools.accumulate(counts)], seq_len, _pad_id(tokenizer))
    return layouts


def _assemble_manifest(config: PrepConfig, tokenizer: Tokenizer, identity: dict, ledger: Ledger,
                       units: Sequence[WorkUnit], layouts: dict[str, _SplitLayout], shards: list[dict],
                       rows_per_chunk: int) -> Manifest:
    entries = [ledger.get(_unit_key(u.index)) for u in units]
    counters = ReadCounters()
    for entry in entries:
        counters = counters + ReadCounters(**entry["counters"])
    splits = {}
    for split, layout in layouts.items():
        infos = [ShardInfo(**ledger.get(_shard_key(split, r["index"]))) for r in shards if r["split"] == split]
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
        format_version=FORMAT_VERSION, tokenizer=tokenizer.describe(), seq_len=config.seq_len,
        dtype=token_dtype(tokenizer.vocab_size).str, chunk_rows=rows_per_chunk, pad_id=_pad_id(tokenizer),
        prep_config=identity["config"], prep_config_sha256=identity["sha256"], inputs=inputs,
        counts=counters.to_dict(), splits=splits)

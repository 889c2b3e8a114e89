"""Stage 1 of ``unmask prep``: work units -> per-split token streams, one unit at a time.

Each unit (``data_prep.readers``) is read, every document encoded, EOS appended, and the
document assigned to train or val by a keyed hash of its content (``SplitRule``: duplicates
share a split); the unit's tokens per split go to ``WORK/units/NNNNNN.{split}.tokens`` with
a table of (tokens, UTF-8 bytes) per document. ``UnitTokenizer`` holds the tokenizer: a Ray
Data actor, or a plain object in a one-worker prep.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from common.errors import UserError
from data_prep.ledger import Ledger
from data_prep.readers import (
    Pieces,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    binary_reason,
    read_batches,
)
from data_prep.shards.format import SPLITS, token_dtype
from data_prep.tokenizer.base import Tokenizer

__all__ = ["SplitRule", "UnitTokenizer", "tokenize_unit", "unit_key"]

HASH_SPACE = 1 << 64


class SplitRule:
    """Train or val by a keyed hash of the document's first piece: duplicates share a split."""

    def __init__(self, seed: int, val_fraction: float) -> None:
        # The keyed state, copied per document: cheaper than keying a new hash each time.
        self._keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))
        # Val: the hash, a little-endian integer, lies below val_fraction * 2**64. For an integer
        # that is "below the ceiling of it", which numpy compares exactly (a uint64 compared
        # with a float is rounded first).
        self._threshold = np.uint64(math.ceil(val_fraction * HASH_SPACE))

    def is_val(self, first_pieces: Sequence[bytes]) -> np.ndarray:
        """Whether each document goes to val, given the UTF-8 bytes of its first piece."""
        if not self._threshold:  # no val split: nothing to hash
            return np.zeros(len(first_pieces), bool)
        digests = []
        for data in first_pieces:
            state = self._keyed.copy()
            state.update(data)
            digests.append(state.digest())
        return np.frombuffer(b"".join(digests), dtype="<u8") < self._threshold


class UnitOutput:
    """A unit's token stream and per-document (tokens, bytes) table for one split."""

    def __init__(self, prefix: Path, split: str) -> None:
        self.tokens_path = prefix.with_name(f"{prefix.name}.{split}.tokens")
        self.docs_path = prefix.with_name(f"{prefix.name}.{split}.docs.npy")
        self._tmp = self.tokens_path.with_name(self.tokens_path.name + ".tmp")
        self._handle = open(self._tmp, "wb")
        self.tables: list[np.ndarray] = []  # (tokens, bytes) rows of the documents ended so far
        self.tokens = 0

    def write(self, tokens: np.ndarray, documents: np.ndarray) -> None:
        """Append the tokens of some pieces and the table rows of the documents they end."""
        self._handle.write(tokens.tobytes())
        self.tokens += len(tokens)
        self.tables.append(documents)

    def close(self) -> np.ndarray:
        """Finish both files; return the document table."""
        self._handle.close()
        self._tmp.replace(self.tokens_path)
        table = np.concatenate([np.empty((0, 2), np.int64), *self.tables])
        tmp = self.docs_path.with_name(self.docs_path.name + ".tmp.npy")
        np.save(tmp, table)
        tmp.replace(self.docs_path)
        return table


@dataclass
class OpenDocument:
    """A document whose last piece is in a later batch: what its pieces so far add up to."""

    tokens: int
    utf8_bytes: int
    is_val: bool


class BatchSplitter:
    """Sends a batch of encoded pieces, in stream order, to the split of their document.

    The work is done on arrays, a batch at a time: with documents of a few dozen tokens, a
    Python loop over the pieces cost a third of the encoder's time. Every piece belongs to the
    document of the last first piece before it, or to the document left open by the batch
    before (``OpenDocument``)."""

    def __init__(self, rule: SplitRule, outputs: dict[str, UnitOutput], dtype: np.dtype) -> None:
        self.rule, self.outputs, self.dtype = rule, outputs, dtype
        self.open: OpenDocument | None = None

    def write(self, batch: Pieces, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Write the pieces of ``batch``: their ids back to back, EOS after each last piece
        (``tokens``), and the number of ids of each (``counts``)."""
        starts, is_val, table = self._documents(batch, counts)
        ended = len(starts) - 1 + batch.last[-1]  # documents end in order; the last may go on
        self.open = None if ended == len(starts) else OpenDocument(*table[-1].tolist(), bool(is_val[-1]))
        token_is_val = np.repeat(np.repeat(is_val, np.diff(np.r_[starts, len(batch)])), counts)
        tokens = tokens.astype(self.dtype, copy=False)
        for split, wanted in zip(SPLITS, (False, True)):
            self.outputs[split].write(tokens[token_is_val == wanted], table[:ended][is_val[:ended] == wanted])

    def _documents(self, batch: Pieces, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The documents of the batch's pieces: the index of each one's first piece in the
        batch (0 for the one left open before), whether it goes to val, and its (tokens, bytes)
        so far."""
        starts = np.flatnonzero(batch.first)
        is_val = self.rule.is_val(list(itertools.compress(batch.datas, batch.first)))
        if self.open is not None:
            starts, is_val = np.r_[0, starts], np.r_[self.open.is_val, is_val]
        nbytes = np.fromiter(map(len, batch.datas), np.int64, len(batch))
        table = np.stack([np.add.reduceat(counts, starts), np.add.reduceat(nbytes, starts)], axis=1)
        if self.open is not None:
            table[0] += (self.open.tokens, self.open.utf8_bytes)
        return starts, is_val, table


def tokenize_unit(unit: WorkUnit, tokenizer: Tokenizer, options: ReadOptions, rule: SplitRule,
                  prefix: Path, dtype: np.dtype) -> dict:
    """Tokenize one unit into ``prefix.{split}.tokens``; return its ledger entry."""
    counters = ReadCounters()
    outputs = {split: UnitOutput(prefix, split) for split in SPLITS}
    splitter = BatchSplitter(rule, outputs, dtype)
    for batch in read_batches(unit, options, counters):
        tokens, counts = tokenizer.encode_pieces(batch.texts, batch.last)
        splitter.write(batch, tokens, counts)
    tables = {split: output.close() for split, output in outputs.items()}
    entry = {"index": unit.index, "counters": counters.to_dict(),
             "splits": {split: {"tokens": outputs[split].tokens, "documents": len(table),
                                "utf8_bytes": int(table[:, 1].sum())}
                        for split, table in tables.items()}}
    if counters.binary_files_skipped:
        entry["binary_file"] = {"uri": unit.file.uri, "reason": binary_reason(unit.file)}
    return entry


class UnitTokenizer:
    """Holds the tokenizer and tokenizes the units it is handed: a Ray Data actor (``__call__``
    takes a batch of unit indices), or a plain object in a one-worker prep (``tokenize``)."""

    def __init__(self, tokenizer: Tokenizer, units: list[WorkUnit], read: ReadOptions, seed: int,
                 val_fraction: float, work: str) -> None:
        self.tokenizer, self.units, self.read = tokenizer, units, read
        self.work = Path(work)
        self.rule = SplitRule(seed, val_fraction)
        self.ledger = Ledger(self.work / "ledger")
        self.dtype = token_dtype(tokenizer.vocab_size)

    def tokenize(self, index: int) -> dict:
        """Tokenize unit ``index`` and record it in the ledger. Returns its row: tokens, busy
        seconds, and the message of the user error that stopped it ("" if none)."""
        prefix = self.work / "units" / f"{index:06d}"
        started = time.perf_counter()
        try:
            entry = tokenize_unit(self.units[index], self.tokenizer, self.read, self.rule, prefix, self.dtype)
        except UserError as err:  # travels as data: Ray keeps only the text of exceptions
            entry, error = None, str(err)
        except OSError as err:  # e.g. a full disk
            entry, error = None, f"tokenizing {self.units[index].file.uri} into {prefix}: {err}"
        else:
            self.ledger.record(unit_key(index), entry)
            error = ""
        tokens = sum(s["tokens"] for s in entry["splits"].values()) if entry else 0
        return {"index": index, "tokens": tokens, "seconds": time.perf_counter() - started, "error": error}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [self.tokenize(index) for index in batch["index"].tolist()]
        return {"index": batch["index"], "tokens": np.array([r["tokens"] for r in rows], dtype=np.int64),
                "seconds": np.array([r["seconds"] for r in rows]),
                "error": np.array([r["error"] for r in rows], dtype=object)}


def unit_key(index: int) -> str:
    return f"unit-{index:06d}"

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
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from common.errors import UserError
from data_prep.ledger import Ledger
from data_prep.readers import (
    Piece,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    binary_reason,
    read_unit,
)
from data_prep.shards import SPLITS, token_dtype
from data_prep.tokenizer import Tokenizer

__all__ = ["SplitRule", "UnitTokenizer", "tokenize_unit", "unit_key"]

# Pieces per tokenizer call: amortizes the per-call cost of the native batch encoder.
ENCODE_BATCH_PIECES = 256
HASH_SPACE = float(1 << 64)


class SplitRule:
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


class UnitOutput:
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


def tokenize_unit(unit: WorkUnit, tokenizer: Tokenizer, options: ReadOptions, rule: SplitRule,
                  prefix: Path, dtype: np.dtype) -> dict:
    """Tokenize one unit into ``prefix.{split}.tokens``; return its ledger entry.

    The loop runs once per piece, and with short documents its own cost is of the order of the
    encoder's: each piece is turned into bytes once (for the split hash and the byte count)."""
    counters = ReadCounters()
    outputs = {split: UnitOutput(prefix, split, dtype) for split in SPLITS}
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

"""The formats: which reader reads a work unit (plain text, JSONL or Parquet; text and JSONL
gzip'd or not), binary files left out whole."""

from __future__ import annotations

import itertools
from typing import Iterator

from data_prep.readers.byte_source import BINARY_CHECK_BYTES, ByteSource, head_binary_reason
from data_prep.readers.jsonl import read_jsonl
from data_prep.readers.options import ReadOptions
from data_prep.readers.parquet import read_row_groups
from data_prep.readers.pieces import Piece, Pieces, ReadCounters
from data_prep.readers.planning import WorkUnit
from data_prep.readers.text import read_text

__all__ = ["BATCH_BYTES", "BATCH_PIECES", "read_batches", "read_unit"]


# A batch of `read_batches` ends once it holds this many pieces or bytes of text (or at the end
# of the unit): enough to amortize a tokenizer call, little enough to bound a worker's memory
# (a run of lines, which comes whole, adds at most READ_BLOCK_BYTES).
BATCH_PIECES = 4096
BATCH_BYTES = 1 << 20


def read_unit(unit: WorkUnit, options: ReadOptions, counters: ReadCounters) -> Iterator[Piece]:
    """The pieces of the documents that `unit` owns, in file order; fills `counters`.

    Plain text documents are paragraphs (runs of non-blank lines, a blank line being empty or
    only ASCII whitespace, joined with "\\n"), lines, or the whole file as is. A JSONL line is one
    object whose `options.text_field` is the document; blank lines are allowed. A Parquet row's
    `options.text_column` is the document; null counts as empty. A UTF-8 byte-order mark at the
    start of a file is dropped. Empty and whitespace-only documents are skipped.

    Invalid UTF-8 (in JSONL: in the text field) is repaired with U+FFFD or skips the document,
    per `options.bad_utf8`; a skipped document yields no piece, however long it is. For that, a
    plain-text document longer than `options.max_piece_bytes` is read twice: checked, then cut
    into pieces (in a gzip file the second read decompresses again from the file's start).

    A binary text or JSONL file (see `binary_reason`) yields nothing; its first unit counts
    it in `counters.binary_files_skipped`.
    """
    return itertools.chain.from_iterable(read_batches(unit, options, counters))


def read_batches(unit: WorkUnit, options: ReadOptions, counters: ReadCounters) -> Iterator[Pieces]:
    """The pieces of `read_unit`, in batches of columns (see BATCH_PIECES); what the prep reads."""
    batch = None
    for item in _read_items(unit, options, counters):
        if batch is None:
            batch = Pieces(item.origin)
        if isinstance(item, Pieces):
            batch.extend(item)
        else:
            batch.append(item)
        if len(batch) >= BATCH_PIECES or batch.utf8_bytes >= BATCH_BYTES:
            yield batch
            batch = None
    if batch is not None:
        yield batch


def _read_items(unit: WorkUnit, options: ReadOptions, counters: ReadCounters) -> Iterator[Piece | Pieces]:
    if unit.file.format == "parquet":
        yield from read_row_groups(unit.file, range(unit.start, unit.end), options, counters)
        return
    with ByteSource(unit.file) as source:
        if head_binary_reason(source.head(BINARY_CHECK_BYTES)) is not None:
            counters.binary_files_skipped += unit.start == 0  # once per file, by its first unit
            return
        if unit.file.format == "jsonl":
            yield from read_jsonl(source, unit, options, counters)
        else:
            yield from read_text(source, unit, options, counters)

"""The formats: which reader reads a work unit (plain text, JSONL or Parquet; text and JSONL
gzip'd or not), binary files left out whole."""

from __future__ import annotations

from typing import Iterator

from data_prep.readers.byte_source import BINARY_CHECK_BYTES, ByteSource, head_binary_reason
from data_prep.readers.jsonl import read_jsonl
from data_prep.readers.options import ReadOptions
from data_prep.readers.parquet import read_row_groups
from data_prep.readers.pieces import Piece, ReadCounters
from data_prep.readers.planning import WorkUnit
from data_prep.readers.text import read_text

__all__ = ["read_unit"]


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

"""Corpus readers: raw text, JSONL and Parquet corpora in, a stream of document text out.

    files = resolve_inputs(["corpus/**/*.jsonl.gz"])   # which files, in a fixed order
    units = plan_units(files, options)                  # independent work units, in corpus order
    for batch in read_batches(unit, options, counters): # on a worker, one unit at a time
        ...                                             # tokenize batch.texts; EOS after each batch.last

Everything streams: memory does not grow with file or document size (a document longer than
``max_piece_bytes`` comes out in pieces; only a JSONL line is parsed whole). The package's
names are its public API; its modules: ``options`` (the read flags), ``inputs`` (paths, globs,
URIs, formats by name), ``planning`` (work units), ``formats`` (``read_unit``, ``read_batches``),
and below them ``byte_source``, ``lines``, ``paragraphs``, ``long_documents``, ``utf8``,
``pieces``. The manual: docs/data-preparation.md, "Inputs".
"""

from data_prep.readers.byte_source import (
    BINARY_CHECK_BYTES,
    BINARY_FIX,
    READ_BLOCK_BYTES,
    binary_reason,
    skipped_as_binary,
)
from data_prep.readers.formats import read_batches, read_unit
from data_prep.readers.inputs import FileFormat, InputFile, local_roots, resolve_inputs
from data_prep.readers.jsonl import MAX_JSONL_LINE_BYTES
from data_prep.readers.options import (
    DEFAULT_PIECE_BYTES,
    MIN_PIECE_BYTES,
    BadJson,
    BadUtf8,
    ReadOptions,
    TextFormat,
)
from data_prep.readers.pieces import Piece, Pieces, ReadCounters
from data_prep.readers.planning import DEFAULT_UNIT_BYTES, WorkUnit, plan_units

__all__ = [
    "BINARY_CHECK_BYTES", "BINARY_FIX", "DEFAULT_PIECE_BYTES", "DEFAULT_UNIT_BYTES", "MAX_JSONL_LINE_BYTES",
    "MIN_PIECE_BYTES", "READ_BLOCK_BYTES", "BadJson", "BadUtf8", "FileFormat", "InputFile",
    "Piece", "Pieces", "ReadCounters", "ReadOptions", "TextFormat", "WorkUnit", "binary_reason",
    "local_roots", "plan_units", "read_batches", "read_unit", "resolve_inputs",
    "skipped_as_binary",
]

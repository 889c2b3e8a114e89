"""Corpus readers: raw text, JSONL and Parquet corpora in, a stream of document text out.

The data-preparation stage uses them in three steps:

    files = resolve_inputs(["corpus/**/*.jsonl.gz"])   # which files, in a fixed order
    units = plan_units(files, options)                  # independent work units, in corpus order
    for batch in read_batches(unit, options, counters): # on a Ray worker, one unit at a time
        ...                                             # tokenize batch.texts; EOS after each batch.last

(``read_unit`` gives the same pieces one at a time.)

Everything streams: files are read in blocks of READ_BLOCK_BYTES, and a document longer than
``max_piece_bytes`` comes out as several pieces, so memory does not grow with file or document
size (except that a JSONL line is parsed whole).

One module per concern, and this package's names are their public API:

- ``options``: ReadOptions, the read flags;
- ``inputs``: input resolution (paths, globs with ``**``, pyarrow filesystem URIs), formats by name;
- ``planning``: work units (byte ranges, whole gzip files, runs of Parquet row groups);
- ``formats``: ``read_unit``, which hands a unit to ``text``, ``jsonl`` or ``parquet``, and
  ``read_batches``, the same pieces in batches of columns (``Pieces``), as the prep reads them;
- the byte, line and UTF-8 machinery below them: ``byte_source`` (blocks, gzip, byte-order
  marks, binary files), ``lines``, ``paragraphs``, ``long_documents`` (documents too long to
  hold), ``utf8`` (repair and checks) and ``pieces`` (what is kept and counted, and the cutting
  of long documents into pieces).
"""

from data_prep.readers.byte_source import BINARY_CHECK_BYTES, READ_BLOCK_BYTES, binary_reason
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
    "BINARY_CHECK_BYTES", "DEFAULT_PIECE_BYTES", "DEFAULT_UNIT_BYTES", "MAX_JSONL_LINE_BYTES",
    "MIN_PIECE_BYTES", "READ_BLOCK_BYTES", "BadJson", "BadUtf8", "FileFormat", "InputFile",
    "Piece", "Pieces", "ReadCounters", "ReadOptions", "TextFormat", "WorkUnit", "binary_reason",
    "local_roots", "plan_units", "read_batches", "read_unit", "resolve_inputs",
]

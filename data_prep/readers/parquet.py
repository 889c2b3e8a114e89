"""Parquet: one document per row, the text column read row group by row group."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError
from data_prep.readers.inputs import InputFile, filesystem
from data_prep.readers.options import ReadOptions
from data_prep.readers.pieces import Piece, ReadCounters, pieces
from data_prep.readers.utf8 import decode

__all__ = ["read_row_groups", "row_group_text_bytes"]

# Arrow types a text column may have, each with the binary type that views the same bytes.
_TEXT_COLUMN_TYPES = {
    pa.string(): pa.binary(), pa.large_string(): pa.large_binary(),
    pa.binary(): pa.binary(), pa.large_binary(): pa.large_binary(),
}


def row_group_text_bytes(file: InputFile, column: str) -> list[int]:
    """The uncompressed bytes of the text column in each row group of a Parquet file (what
    planning sizes its units by), the column checked first."""
    fs, path = filesystem(file.uri)
    with fs.open_input_file(path) as handle:
        parquet = _parquet_file(handle, file)
        _check_text_column(parquet, file, column)
        metadata = parquet.metadata
        leaves = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
        leaf = leaves.index(column)
        return [metadata.row_group(group).column(leaf).total_uncompressed_size
                for group in range(metadata.num_row_groups)]


def read_row_groups(file: InputFile, row_groups: range, options: ReadOptions,
                    counters: ReadCounters) -> Iterator[Piece]:
    """The pieces of the documents in `row_groups` of a Parquet file, in row order; fills
    `counters`. A null counts as empty; invalid UTF-8 is handled per `options.bad_utf8`."""
    fs, path = filesystem(file.uri)
    with fs.open_input_file(path) as handle:
        parquet = _parquet_file(handle, file)
        _check_text_column(parquet, file, options.text_column)
        row = sum(parquet.metadata.row_group(group).num_rows for group in range(row_groups.start))
        origin = f"{file.uri}#row="
        batches = parquet.iter_batches(row_groups=list(row_groups), columns=[options.text_column])
        for batch in batches:
            column = batch.column(0)
            # As bytes: Parquet readers do not check that strings are UTF-8; --bad-utf8 decides.
            for value in column.view(_TEXT_COLUMN_TYPES[column.type]).to_pylist():
                value = value or b""  # null counts as empty
                text, bad_utf8 = decode(value)
                # Cut like a JSON string: the repaired text's bytes.
                yield from pieces(text, text.encode() if bad_utf8 else value, bad_utf8,
                                  origin, row, options, counters)
                row += 1


def _parquet_file(handle: pa.NativeFile, file: InputFile) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(handle)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{file.uri}: not a readable Parquet file ({err})") from err


def _check_text_column(parquet: pq.ParquetFile, file: InputFile, column: str) -> None:
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise UserError(f"{file.uri}: no column {column!r} (columns: {', '.join(schema.names)}); "
                        f"choose the text column with --text-column")
    if schema.field(column).type not in _TEXT_COLUMN_TYPES:
        raise UserError(f"{file.uri}: column {column!r} holds {schema.field(column).type}, not "
                        f"text; choose a string column with --text-column")

"""Parquet (``data_prep.readers.parquet``): one document per row, units of row groups, the text
column checked and named."""

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from data_prep.readers import (
    ReadCounters,
    ReadOptions,
    plan_units,
    read_unit,
    resolve_inputs,
)
from tests.support.readers import (
    documents,
    read_documents,
    read_pieces,
)


def write_parquet(folder: Path, values: list, row_group_size: int) -> Path:
    path = folder / "a.parquet"
    pq.write_table(pa.table({"id": list(range(len(values))), "text": values}), path,
                   row_group_size=row_group_size)
    return path


def test_parquet_row_groups_make_units(tmp_path):
    values = [f"document {i} " * (i % 7) if i % 11 else None for i in range(100)]
    values[5] = "long " * 30
    path = write_parquet(tmp_path, values, row_group_size=10)
    options = ReadOptions(max_piece_bytes=16)
    units = plan_units(resolve_inputs([str(path)]), options, target_unit_bytes=1000)
    assert len(units) in range(2, 10) and units[0].start == 0 and units[-1].end == 10
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    whole, counters = read_pieces([path], options)
    assert read_pieces([path], options, 1000) == (whole, counters)
    assert read_pieces([path], options, 1) == (whole, counters)  # one row group per unit
    expected = [(f"{path}#row={i}", v) for i, v in enumerate(values) if v and v.strip()]
    assert documents(whole) == expected
    assert counters.empty_skipped == 100 - len(expected)
    assert max(len(piece.text.encode()) for piece in whole) <= 16


def test_parquet_bad_utf8_and_missing_or_wrong_column(tmp_path):
    broken = pa.array([b"ok", b"bad \xff"], pa.binary()).view(pa.string())  # unchecked on write
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": broken, "n": [1, 2]}), path)
    docs, counters = read_documents([path], ReadOptions(text_column="body"))
    assert [text for _, text in docs] == ["ok", "bad \ufffd"] and counters.bad_utf8_repaired == 1
    missing = re.escape(str(path)) + ".*'text'.*body, n.*--text-column"
    with pytest.raises(UserError, match=missing):
        plan_units(resolve_inputs([str(path)]), ReadOptions())
    with pytest.raises(UserError, match=missing):  # a unit planned with another --text-column
        unit = plan_units(resolve_inputs([str(path)]), ReadOptions(text_column="body"))[0]
        list(read_unit(unit, ReadOptions(), ReadCounters()))
    with pytest.raises(UserError, match="column 'n' holds int64, not text.*--text-column"):
        read_documents([path], ReadOptions(text_column="n"))

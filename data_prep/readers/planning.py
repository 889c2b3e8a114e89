"""Work-unit planning: the input files cut into units that workers read independently.

A unit is a byte range of an uncompressed text or JSONL file, a whole gzip file, or a run of
Parquet row groups. Byte ranges follow the Hadoop split rule: a unit owns every document that
begins inside its range and reads past its end to finish the last one, so the outputs of a
file's units, concatenated in plan order, are exactly the output of reading the file whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from data_prep.readers.inputs import InputFile
from data_prep.readers.options import ReadOptions
from data_prep.readers.parquet import row_group_text_bytes

__all__ = ["DEFAULT_UNIT_BYTES", "WorkUnit", "plan_units"]

# 64 MiB per unit: big enough that a task's fixed costs (scheduling it, opening the file,
# counting the lines before its range) stay small next to tokenizing it, small enough that an
# OpenWebText-sized corpus (~40 GB) still makes ~600 units to balance over the workers.
DEFAULT_UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class WorkUnit:
    """A part of one file that a worker reads on its own."""

    index: int        # position in the plan; the plan order is the corpus order
    file: InputFile
    start: int        # uncompressed text/JSONL: byte offset; Parquet: first row group; gzip: 0
    end: int          # exclusive byte offset or row group; gzip: the file size (the whole file)

    @property
    def owned_end(self) -> float:
        """Where the unit's documents stop beginning. A gzip unit is the whole file: its end is
        in compressed bytes, which do not compare with offsets in the decompressed text."""
        return math.inf if self.file.compression else self.end


def plan_units(files: Sequence[InputFile], options: ReadOptions,
               target_unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[WorkUnit]:
    """Split the files into work units of about `target_unit_bytes`, numbered in corpus order.

    Uncompressed text and JSONL files are cut into byte ranges; a gzip file, which cannot be
    read from the middle, and a text file read as one document are one unit each; a Parquet
    file is cut between row groups (at least one per unit), sized by its text column.
    """
    if target_unit_bytes < 1:
        raise ValueError(f"target_unit_bytes must be >= 1, got {target_unit_bytes}")
    ranges = [(file, start, end) for file in files
              for start, end in _file_ranges(file, options, target_unit_bytes)]
    return [WorkUnit(index, file, start, end) for index, (file, start, end) in enumerate(ranges)]


def _file_ranges(file: InputFile, options: ReadOptions, target: int) -> list[tuple[int, int]]:
    """The (start, end) of each unit of one file."""
    if file.format == "parquet":
        return _row_group_ranges(row_group_text_bytes(file, options.text_column), target)
    if file.compression or (file.format == "text" and options.text_format == "file"):
        return [(0, file.size)]
    return [(start, min(start + target, file.size)) for start in range(0, file.size, target)]


def _row_group_ranges(sizes: list[int], target: int) -> list[tuple[int, int]]:
    """Runs of consecutive row groups whose text column holds about `target` bytes."""
    ranges, first, total = [], 0, 0
    for group, size in enumerate(sizes):
        total += size
        if total >= target:
            ranges.append((first, group + 1))
            first, total = group + 1, 0
    if first < len(sizes):
        ranges.append((first, len(sizes)))
    return ranges

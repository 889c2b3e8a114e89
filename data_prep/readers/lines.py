"""Lines, read block by block: the lines a work unit owns, runs of whole lines, and lines
longer than a block, which are never held whole.

A line ends at "\\n"; a "\\r" just before it is part of the line end, so CRLF files read like
LF files. A blank line is empty or only ASCII whitespace (what separates paragraphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import Iterable, Iterator

from data_prep.readers.byte_source import READ_BLOCK_BYTES, UTF8_BOM, ByteSource, without_bom
from data_prep.readers.planning import WorkUnit
from data_prep.readers.utf8 import Utf8Check

__all__ = ["ASCII_WHITESPACE", "Line", "WholeDocuments", "first_line", "gather", "is_blank_line", "lf",
           "line_before_is_blank", "line_chunks", "line_documents", "line_runs", "owned_lines"]


@dataclass
class Line:
    """A line longer than a block (in file format: the whole file), gathered from fragments."""

    start: int            # offset of its first byte
    size: int             # bytes, without the line end
    space_only: bool      # empty or only ASCII whitespace: a blank line between paragraphs
    data: bytes | None    # its bytes; None when too long to hold, and then the verdicts:
    bad_utf8: bool = False
    blank: bool = True    # its text is empty or whitespace (Unicode)


@dataclass
class WholeDocuments:
    """Documents that one run of lines holds whole (lines, or paragraphs), in file order: the
    number of each one's first line, and its bytes ("\\n" line ends, none at the end). Most
    documents come this way, a run at a time, which costs a fraction of one at a time."""

    numbers: list[int]
    datas: list[bytes]


def line_documents(source: ByteSource, unit: WorkUnit, keep: int,
                   ) -> Iterator[WholeDocuments | tuple[int, Line]]:
    """The lines that begin in the unit's range, without their line ends: runs of them as
    WholeDocuments, and a line longer than a block as (number, Line) (held if at most `keep`
    bytes)."""
    start, number = first_line(source, unit.start)
    end = unit.owned_end
    if start >= end:
        return
    for _, lines, owned in line_runs(source, start, end, keep):
        if isinstance(lines, Line):
            if not owned:
                return
            yield number, lines
            number += 1
            continue
        if owned:
            split = lf(lines[:owned]).split(b"\n")
            split.pop()  # after the last line end
            yield WholeDocuments(list(range(number, number + len(split))), split)
            number += len(split)
        if owned < len(lines):
            return


def owned_lines(source: ByteSource, unit: WorkUnit, keep: int,
                ) -> Iterator[tuple[int, bytes | Line]]:
    """The lines of `line_documents`, one at a time as (number, bytes or Line)."""
    for item in line_documents(source, unit, keep):
        if isinstance(item, WholeDocuments):
            yield from zip(item.numbers, item.datas)
        else:
            yield item


def first_line(source: ByteSource, start: int) -> tuple[int, int]:
    """The offset and 1-based number of the first line that begins at or after `start`.

    Numbering counts the newlines before it, which reads the file up to `start` once more.
    """
    if start == 0:
        return 0, 1
    offset = start - 1  # a line begins at `start` only if the byte before it is "\n"
    for block in source.blocks(offset):
        newline = block.find(b"\n")
        if newline >= 0:
            offset += newline + 1
            break
        offset += len(block)
    newlines = sum(source.read_at(begin, min(READ_BLOCK_BYTES, offset - begin)).count(b"\n")
                   for begin in range(0, offset, READ_BLOCK_BYTES))
    return offset, newlines + 1


def line_before_is_blank(source: ByteSource, start: int) -> bool:
    """Whether the line that ends just before `start` (a line start > 0) is blank, reading
    backwards only until a byte decides it."""
    end = start - 1  # its "\n"
    while end > 0:
        begin = max(0, end - READ_BLOCK_BYTES)
        block = source.read_at(begin, end - begin)
        newline = block.rfind(b"\n")
        tail = block[newline + 1:]
        if newline < 0 and begin == 0:
            tail = tail.removeprefix(UTF8_BOM)  # the file's first line: the mark is not text
        if tail and not tail.isspace():
            return False
        if newline >= 0:
            return True
        end = begin
    return True


def line_chunks(source: ByteSource, start: int) -> Iterator[tuple[int, bytes, bool]]:
    """The text from offset `start` (a line start) as (offset, chunk, ends a line), in order.

    Mostly a chunk is the run of whole lines that a block completes, each with its line end,
    at the offset of its first byte; the file's last line gets a "\\n" if it has none. A line
    longer than a block comes in fragments, the last with its line end, all at the line's
    offset, so no line is ever held whole: group chunks by offset.
    """
    blocks = source.blocks(start)
    skip = 0
    if start == 0:
        skip, blocks = without_bom(blocks)
    offset, pending = start + skip, b""  # `offset`: where `pending` begins
    long_line = None  # the offset of a line passed on in fragments, while its end is unread
    for block in blocks:
        data = pending + block
        begin = 0
        if long_line is not None and (newline := data.find(b"\n")) >= 0:
            begin = newline + 1
            yield long_line, data[:begin], True
            long_line = None
        if long_line is None and (last := data.rfind(b"\n") + 1) > begin:
            yield offset + begin, data[begin:last], True
            begin = last
        if len(data) - begin >= READ_BLOCK_BYTES:
            # A long line: pass it on now, but keep a final "\r", which may be half a "\r\n".
            long_line = offset + begin if long_line is None else long_line
            cut = len(data) - 1 if data.endswith(b"\r") else len(data)
            yield long_line, data[begin:cut], False
            begin = cut
        pending = data[begin:]
        offset += begin
    if pending:
        yield offset if long_line is None else long_line, pending + b"\n", True


def line_runs(source: ByteSource, start: int, end: float, keep: int,
              ) -> Iterator[tuple[int, bytes | Line, int]]:
    """The lines from offset `start` (a line that begins before `end`) as (offset, lines,
    owned bytes); the caller numbers them, which costs it less than counting newlines here.

    `lines` is a run of whole lines, each with its line end, or a line longer than a block
    as a Line (held if at most `keep` bytes). The owned bytes are the ones at its start that
    hold lines beginning before `end` (a Line: 1 if it does, else 0); the first line always
    does, even when a byte-order mark puts its text past `end`.
    """
    first = True
    for offset, chunks in groupby(line_chunks(source, start), key=itemgetter(0)):
        room = max(end - offset, 1) if first else end - offset
        _, data, ends_line = next(chunks)
        if ends_line:
            yield offset, data, _owned_bytes(data, room)
        else:
            yield offset, gather(offset, _fragments(data, chunks), keep), room > 0
        first = False


# What bytes.isspace() accepts: the characters a blank line may hold (Line.space_only).
ASCII_WHITESPACE = " \t\n\r\x0b\x0c"


def is_blank_line(line: str) -> bool:
    """The one definition of a blank line, for text already decoded (the evaluation datasets
    read with it): empty or only ASCII whitespace, as ``Line.space_only`` decides on bytes.
    A line of other whitespace (U+00A0, U+3000...) is text."""
    return not line.strip(ASCII_WHITESPACE)


def gather(start: int, chunks: Iterable[bytes], keep: int) -> Line:
    """A line from its chunks: kept if at most `keep` bytes in all, else checked as they pass."""
    kept: list[bytes] = []
    size, space_only, check = 0, True, None
    for chunk in chunks:
        size += len(chunk)
        space_only = space_only and (not chunk or chunk.isspace())
        if check is not None:
            check.feed(chunk)
            continue
        kept.append(chunk)
        if size > keep:
            check = Utf8Check()
            for part in kept:
                check.feed(part)
            kept = []
    if check is None:
        return Line(start, size, space_only, b"".join(kept))
    check.feed(b"", final=True)
    return Line(start, size, space_only, None, check.bad_utf8, check.blank)


def lf(data: bytes) -> bytes:
    """Whole lines with "\\n" line ends: the "\\r" of a "\\r\\n" is part of the line end."""
    # Looking for one byte is some 50x faster than for two, and most files have no "\r".
    return data.replace(b"\r\n", b"\n") if b"\r" in data else data


def _owned_bytes(lines: bytes, room: float) -> int:
    """How many bytes at the start of `lines` (whole lines) hold the lines that begin in its
    first `room` bytes."""
    if room >= len(lines):
        return len(lines)
    return lines.find(b"\n", room - 1) + 1 if room > 0 else 0


def _fragments(first: bytes, chunks: Iterable[tuple[int, bytes, bool]]) -> Iterator[bytes]:
    """A long line's fragments, its line end left out."""
    yield first
    for _, data, ends_line in chunks:
        yield data[:-1].removesuffix(b"\r") if ends_line else data

"""Paragraphs: runs of non-blank lines, joined with "\\n", separated by blank lines (empty, or
only ASCII whitespace: " ", "\\t", "\\r", "\\x0b", "\\x0c"). A line of other whitespace (U+00A0,
U+3000, ...) is text, so it belongs to its paragraph; a paragraph of nothing else is empty,
and skipped as such."""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Iterator

from data_prep.readers.byte_source import ByteSource
from data_prep.readers.lines import Line, WholeDocuments, first_line, lf, line_before_is_blank, line_runs
from data_prep.readers.long_documents import LongDocument
from data_prep.readers.planning import WorkUnit

__all__ = ["paragraphs"]

# A "\n" and the blank lines after it (empty, or only ASCII whitespace, "\r" included), which
# end a paragraph. Starting with a plain "\n" lets the regex engine skip ahead to each "\n"
# (an optional "\r" first would make it try every byte, 8x slower), so the "\r" of a "\r\n"
# before it stays with the paragraph. Captured, so that splitting keeps the separators.
_PARAGRAPH_END = re.compile(rb"(\n[ \t\r\x0b\x0c]*\n(?:[ \t\r\x0b\x0c]*\n)*)")
# The blank lines at the start of a run of whole lines.
_LEADING_BLANK_LINES = re.compile(rb"(?:[ \t\r\x0b\x0c]*\n)*")


@dataclass
class _Run:
    """How a run of whole lines (or a long line) divides: whether it starts with a blank line;
    the paragraphs a blank line ends in it (`WholeDocuments`, with their offsets in the run);
    the lines after the last of them, which may go on in the next run (offset, line number,
    bytes or a long line; None if none); the number of the line after the run."""

    after_blank: bool
    ended: WholeDocuments
    begins: list[int]
    open: tuple[int, int, bytes | Line] | None
    next_number: int


def paragraphs(source: ByteSource, unit: WorkUnit, limit: int,
               ) -> Iterator[tuple[int, bytes | LongDocument] | WholeDocuments]:
    """The paragraphs whose first line begins in the unit's range: runs of them held whole
    (`WholeDocuments`), and others one at a time as (line number, bytes, or a LongDocument
    when longer than `limit` or than a run of lines)."""
    start, number = first_line(source, unit.start)
    end = unit.owned_end
    if start >= end:
        return
    # Unless a blank line ends just before it, the first line goes on with a paragraph that an
    # earlier unit owns.
    continued = start > 0 and not line_before_is_blank(source, start)
    paragraph, first_number = None, 0  # a paragraph that goes on past the run before
    for offset, lines, owned in line_runs(source, start, end, limit):
        run = _divide(lines, number)
        number = run.next_number
        if run.after_blank:
            if paragraph is not None:
                yield first_number, paragraph.held()
            paragraph, continued = None, False
        first = 0  # the first ended paragraph that starts in this run
        if run.ended.datas and (continued or paragraph is not None):
            if paragraph is not None:  # it ends here
                paragraph.add(run.ended.datas[0])
                yield first_number, paragraph.held()
            paragraph, continued, first = None, False, 1
        owned_count = bisect_left(run.begins, owned)
        if first < owned_count:
            yield WholeDocuments(run.ended.numbers[first:owned_count], run.ended.datas[first:owned_count])
        if owned_count < len(run.begins):
            return  # the rest of the run starts paragraphs that a later unit owns
        if run.open is None or continued:
            continue
        begin, line, part = run.open
        if paragraph is None:
            if begin >= owned:
                return
            paragraph, first_number = LongDocument(offset + begin, limit), line
        paragraph.add(part)
    if paragraph is not None:
        yield first_number, paragraph.held()


def _divide(lines: bytes | Line, number: int) -> _Run:
    """How a run of whole lines (or a long line) from line `number` divides (`_Run`)."""
    if isinstance(lines, Line):
        part = None if lines.space_only else (0, number, lines)
        return _Run(lines.space_only, WholeDocuments([], []), [], part, number + 1)
    begin = _LEADING_BLANK_LINES.match(lines).end()
    number += lines.count(b"\n", 0, begin)
    # paragraph, separator, paragraph, ..., and what follows the last separator
    parts = _PARAGRAPH_END.split(lines[begin:])
    begins = list(accumulate(map(len, parts), initial=begin))
    numbers = list(accumulate(map(bytes.count, parts, repeat(b"\n")), initial=number))
    last = len(parts) - 1
    datas, tail = parts[0:last:2], parts[last]
    if b"\r" in lines:  # a "\r\n" line end reads as "\n"
        datas = [lf(data).removesuffix(b"\r") for data in datas]
    open_part = (begins[last], numbers[last], lf(tail)[:-1]) if tail else None
    return _Run(begin > 0, WholeDocuments(numbers[0:last:2], datas), begins[0:last:2], open_part, numbers[-1])

"""Paragraphs: runs of non-blank lines, joined with "\\n", separated by blank lines (empty, or
only ASCII whitespace: " ", "\\t", "\\r", "\\x0b", "\\x0c"). A line of other whitespace (U+00A0,
U+3000, ...) is text, so it belongs to its paragraph; a paragraph of nothing else is empty,
and skipped as such."""

from __future__ import annotations

import re
from typing import Iterator

from data_prep.readers.byte_source import ByteSource
from data_prep.readers.lines import Line, first_line, lf, line_before_is_blank, line_runs
from data_prep.readers.long_documents import LongDocument
from data_prep.readers.planning import WorkUnit

__all__ = ["paragraphs"]

# A "\n" and the blank lines after it (empty, or only ASCII whitespace, "\r" included), which
# end a paragraph. Starting with a plain "\n" lets the regex engine skip ahead to each "\n"
# (an optional "\r" first would make it try every byte, 8x slower), so the "\r" of a "\r\n"
# before it stays with the paragraph.
_PARAGRAPH_END = re.compile(rb"\n[ \t\r\x0b\x0c]*\n(?:[ \t\r\x0b\x0c]*\n)*")
# The blank lines at the start of a run of whole lines.
_LEADING_BLANK_LINES = re.compile(rb"(?:[ \t\r\x0b\x0c]*\n)*")


def paragraphs(source: ByteSource, unit: WorkUnit, limit: int,
               ) -> Iterator[tuple[int, bytes | LongDocument]]:
    """The paragraphs whose first line begins in the unit's range, as (line number, bytes or a
    LongDocument when longer than `limit` or than a run of lines)."""
    start, number = first_line(source, unit.start)
    end = unit.owned_end
    if start >= end:
        return
    # Unless a blank line ends just before it, the first line goes on with a paragraph that an
    # earlier unit owns.
    continued = start > 0 and not line_before_is_blank(source, start)
    paragraph, first_number = None, 0  # a paragraph that goes on past the run before
    for offset, lines, owned in line_runs(source, start, end, limit):
        after_blank, parts, next_number = _paragraph_parts(lines, number)
        if after_blank:
            if paragraph is not None:
                yield first_number, paragraph.held()
            paragraph, continued = None, False
        for begin, line, part, ended in parts:
            if continued:
                continued = not ended
                continue
            if paragraph is None:
                if begin >= owned:
                    return
                if ended:  # the usual case: the whole paragraph is in the run
                    yield line, part
                    continue
                paragraph, first_number = LongDocument(offset + begin, limit), line
            paragraph.add(part)
            if ended:
                yield first_number, paragraph.held()
                paragraph = None
        number = next_number
    if paragraph is not None:
        yield first_number, paragraph.held()


def _paragraph_parts(lines: bytes | Line, number: int,
                     ) -> tuple[bool, list[tuple[int, int, bytes | Line, bool]], int]:
    """How a run of whole lines (or a long line) from line `number` divides: whether it starts
    with a blank line; its stretches of non-blank lines as (position, line number, bytes with
    "\\n" line ends, whether a blank line ends it in the run); the number of the line after it."""
    parts: list[tuple[int, int, bytes | Line, bool]] = []
    if isinstance(lines, Line):
        if not lines.space_only:
            parts.append((0, number, lines, False))
        return lines.space_only, parts, number + 1
    begin = _LEADING_BLANK_LINES.match(lines).end()
    after_blank, number = begin > 0, number + lines.count(b"\n", 0, begin)
    crlf = b"\r" in lines  # else the parts need no line ends changed
    for match in _PARAGRAPH_END.finditer(lines, begin):
        end, after = match.span()
        part = lines[begin:end]
        parts.append((begin, number, lf(part).removesuffix(b"\r") if crlf else part, True))
        number += lines.count(b"\n", begin, after)
        begin = after
    if begin < len(lines):
        parts.append((begin, number, lf(lines[begin:])[:-1], False))
        number += lines.count(b"\n", begin)
    return after_blank, parts, number

"""Huge documents in bounded memory: a plain-text document that no run of lines holds whole
is checked as its parts pass (valid UTF-8? only whitespace?) and, if kept, read again from
the file to be cut into pieces. So --bad-utf8 skip drops it before any piece goes out."""

from __future__ import annotations

from typing import Iterator

from data_prep.readers.byte_source import ByteSource, without_bom
from data_prep.readers.lines import Line, lf, line_chunks
from data_prep.readers.options import TextFormat
from data_prep.readers.utf8 import Utf8Check

__all__ = ["LongDocument", "document_bytes"]


class LongDocument:
    """A document that no run of lines holds whole: it goes on past a run, or has a line longer
    than a block. Keeps its bytes while they fit in one piece; a longer one is checked as its
    parts pass, and read again to cut it into pieces."""

    def __init__(self, start: int, limit: int) -> None:
        self.start = start
        self.size = -1  # bytes with "\n" line ends; no "\n" before the first part
        self.bad_utf8, self.blank = False, True  # the verdicts, once `held` returns it
        self._limit = limit
        self._parts: list[bytes] | None = []
        self._check = Utf8Check()

    def add(self, part: bytes | Line) -> None:
        """Append lines after a "\\n": bytes with "\\n" line ends, or a long line."""
        data = part.data if isinstance(part, Line) else part
        self.size += 1 + (part.size if isinstance(part, Line) else len(part))
        if self._parts is not None:
            if data is not None and self.size <= self._limit:
                self._parts.append(data)
                return
            self._check.feed(b"\n".join(self._parts))  # too long to hold from now on
            self._parts = None
        self._check.feed(b"\n")  # also ends a character left unfinished, which is invalid
        if data is not None:
            self._check.feed(data)
        else:
            self.bad_utf8 = self.bad_utf8 or part.bad_utf8
            self.blank = self.blank and part.blank

    @classmethod
    def of(cls, line: Line, limit: int) -> bytes | LongDocument:
        """A document of one long line: its bytes if it fits in one piece, else its verdicts."""
        document = cls(line.start, limit)
        document.add(line)
        return document.held()

    def held(self) -> bytes | LongDocument:
        """Its bytes if it fits in one piece; else itself, its verdicts complete."""
        if self._parts is not None:
            return b"\n".join(self._parts)
        self._check.feed(b"", final=True)
        self.bad_utf8 = self.bad_utf8 or self._check.bad_utf8
        self.blank = self.blank and self._check.blank
        return self


def document_bytes(source: ByteSource, document: LongDocument, text_format: TextFormat,
                   ) -> Iterator[bytes]:
    """A long document's bytes, read again: the text from its start with "\\n" line ends, up
    to its size; or the whole file."""
    if text_format == "file":
        yield from without_bom(source.blocks(0))[1]
        return
    left = document.size
    for _, chunk, _ in line_chunks(source, document.start):
        chunk = lf(chunk)  # a fragment has no "\n", so no "\r\n" either
        if len(chunk) >= left:
            yield chunk[:left]
            return
        yield chunk
        left -= len(chunk)

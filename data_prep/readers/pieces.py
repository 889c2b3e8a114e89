"""Documents to pieces: which documents are kept (empty ones and, per --bad-utf8, invalid
ones are not), what is counted, and how a long document is cut into pieces of bounded size."""

from __future__ import annotations

import codecs
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Iterator

from data_prep.readers.options import ReadOptions
from data_prep.readers.utf8 import is_blank

__all__ = ["Piece", "ReadCounters", "flagged", "keep", "pieces", "split_pieces"]


@dataclass(frozen=True)
class Piece:
    """A document, or a part of one: concatenating a document's pieces gives its text."""

    text: str
    source: str       # where the document starts: "path:LINE" (1-based), or "path#row=N" (0-based)
    first: bool       # first piece of its document
    last: bool        # last piece of its document (EOS goes after it)


@dataclass
class ReadCounters:
    """What reading kept and dropped; a worker fills one per unit and the driver sums them."""

    documents: int = 0          # documents yielded
    utf8_bytes: int = 0         # UTF-8 bytes of their text, after repair (for bits per byte)
    empty_skipped: int = 0      # empty or whitespace-only documents
    bad_utf8_repaired: int = 0  # documents yielded with invalid UTF-8 replaced by U+FFFD
    bad_utf8_skipped: int = 0   # documents dropped for invalid UTF-8 (--bad-utf8 skip)
    bad_json_skipped: int = 0   # JSONL lines dropped as broken (--bad-json skip)
    binary_files_skipped: int = 0  # text/JSONL files left out whole as binary (binary_reason)

    def __add__(self, other: ReadCounters) -> ReadCounters:
        return ReadCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)})

    def to_dict(self) -> dict[str, int]:
        """The counts by name, as the manifest and the ledger record them."""
        return asdict(self)


def keep(bad_utf8: bool, blank: bool, options: ReadOptions, counters: ReadCounters) -> bool:
    """Whether to yield a document, per --bad-utf8 and the empty-document rule; counts it."""
    if bad_utf8 and options.bad_utf8 == "skip":
        counters.bad_utf8_skipped += 1
        return False
    if blank:
        counters.empty_skipped += 1
        return False
    counters.bad_utf8_repaired += bad_utf8
    return True


def pieces(text: str, data: bytes, bad_utf8: bool, source: str, options: ReadOptions,
           counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document held in memory, if kept: `text` whole if `data`, its bytes
    (in plain text: before any repair), fit in one piece, else `data` cut into pieces. A plain
    function, not a generator: most documents are one piece, and it runs once per document."""
    if not keep(bad_utf8, is_blank(text), options, counters):
        return ()
    if len(data) > options.max_piece_bytes:
        return flagged(split_pieces([data], options.max_piece_bytes), source, counters)
    counters.documents += 1
    counters.utf8_bytes += len(text.encode()) if bad_utf8 else len(data)
    return (Piece(text, source, True, True),)


def split_pieces(chunks: Iterable[bytes], limit: int) -> Iterator[str]:
    """A long document's text, from its bytes, in pieces of at most `limit` of those bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # one decoder: pieces join exactly
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        while len(buffer) > limit:
            cut = _cut_point(buffer, limit)
            # Empty only if the piece is just the start of an invalid sequence, which the
            # decoder holds for the next piece.
            if text := decoder.decode(buffer[:cut]):
                yield text
            del buffer[:cut]
    yield decoder.decode(buffer, final=True)


def flagged(texts: Iterable[str], source: str, counters: ReadCounters) -> Iterator[Piece]:
    """A document's pieces with their first/last flags; counts the document and its bytes."""
    texts = iter(texts)
    current, first = next(texts), True
    for following in texts:
        counters.utf8_bytes += len(current.encode())
        yield Piece(current, source, first, False)
        current, first = following, False
    counters.documents += 1
    counters.utf8_bytes += len(current.encode())
    yield Piece(current, source, first, True)


def _cut_point(data: bytearray, limit: int) -> int:
    """Where to end a piece within data[:limit]: after its last newline, else after its last
    space or tab, else before the character that straddles `limit`."""
    newline = data.rfind(b"\n", 0, limit)
    if newline >= 0:
        return newline + 1
    space = max(data.rfind(b" ", 0, limit), data.rfind(b"\t", 0, limit))
    if space >= 0:
        return space + 1
    cut = limit
    # Back up over UTF-8 continuation bytes (10xxxxxx); a valid character has at most 3.
    while cut > limit - 3 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut

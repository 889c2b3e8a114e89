"""Documents to pieces: which documents are kept (empty ones and, per --bad-utf8, invalid
ones are not), what is counted, and how a long document is cut into pieces of bounded size."""

from __future__ import annotations

import codecs
from dataclasses import asdict, dataclass, field, fields
from itertools import repeat
from typing import Iterable, Iterator

from data_prep.readers.options import ReadOptions
from data_prep.readers.utf8 import is_blank

__all__ = ["Piece", "Pieces", "ReadCounters", "flagged", "keep", "pieces", "split_pieces"]


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which made
# building the Piece a sixth of the prep's per-document time on short documents.
@dataclass(slots=True)
class Piece:
    """A document, or a part of one: concatenating a document's pieces gives its text."""

    text: str
    data: bytes       # the UTF-8 bytes of `text`, which the reader has at hand
    origin: str       # its file and a separator: "path:" or "path#row="
    number: int       # where the document starts there: a line (1-based) or a row (0-based)
    first: bool       # first piece of its document
    last: bool        # last piece of its document (EOS goes after it)

    @property
    def source(self) -> str:
        """Where the document starts: "path:LINE" or "path#row=N"."""
        return f"{self.origin}{self.number}"


@dataclass
class Pieces:
    """Consecutive pieces of one file, in columns (the fields of `Piece`, a list each). The
    readers hand out most documents this way, a run of lines at a time, and the prep encodes
    them a batch at a time: an object per piece cost about a twentieth of the encoder's time
    on documents of a few dozen tokens."""

    origin: str
    texts: list[str] = field(default_factory=list)
    datas: list[bytes] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    last: list[bool] = field(default_factory=list)
    utf8_bytes: int = 0  # of all the pieces

    @classmethod
    def whole_documents(cls, origin: str, texts: list[str], datas: list[bytes], numbers: list[int]) -> Pieces:
        """Documents of one piece each."""
        ends = [True] * len(texts)
        return cls(origin, texts, datas, numbers, ends, ends.copy(), sum(map(len, datas)))

    def __len__(self) -> int:
        return len(self.texts)

    def __iter__(self) -> Iterator[Piece]:
        return map(Piece, self.texts, self.datas, repeat(self.origin), self.numbers, self.first, self.last)

    def append(self, piece: Piece) -> None:
        """Add a piece of the same file after the others."""
        self.texts.append(piece.text)
        self.datas.append(piece.data)
        self.numbers.append(piece.number)
        self.first.append(piece.first)
        self.last.append(piece.last)
        self.utf8_bytes += len(piece.data)

    def extend(self, other: Pieces) -> None:
        """Add the pieces of `other`, of the same file, after these."""
        self.texts += other.texts
        self.datas += other.datas
        self.numbers += other.numbers
        self.first += other.first
        self.last += other.last
        self.utf8_bytes += other.utf8_bytes


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


def pieces(text: str, data: bytes, bad_utf8: bool, origin: str, number: int, options: ReadOptions,
           counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document held in memory, if kept: `text` whole if `data`, its bytes
    (in plain text: before any repair), fit in one piece, else `data` cut into pieces. A plain
    function, not a generator: most documents are one piece, and it runs once per document."""
    if not keep(bad_utf8, is_blank(text), options, counters):
        return ()
    if len(data) > options.max_piece_bytes:
        return flagged(split_pieces([data], options.max_piece_bytes), origin, number, counters)
    if bad_utf8:
        data = text.encode()
    counters.documents += 1
    counters.utf8_bytes += len(data)
    return (Piece(text, data, origin, number, True, True),)


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


def flagged(texts: Iterable[str], origin: str, number: int, counters: ReadCounters) -> Iterator[Piece]:
    """A document's pieces with their first/last flags; counts the document and its bytes."""
    texts = iter(texts)
    current, first = next(texts), True
    for following in texts:
        data = current.encode()
        counters.utf8_bytes += len(data)
        yield Piece(current, data, origin, number, first, False)
        current, first = following, False
    data = current.encode()
    counters.documents += 1
    counters.utf8_bytes += len(data)
    yield Piece(current, data, origin, number, first, True)


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

"""Reading a corpus as the prep does, for the readers' tests: files written on the spot
(``write``), every piece of the planned units in order (``read_pieces``), documents put back
together from their pieces, checking the first/last flags (``documents``), and a plain
all-in-memory statement of the text formats to compare with (``reference_text_documents``)."""

import codecs
import random
import re
from pathlib import Path

from data_prep.readers import (
    DEFAULT_UNIT_BYTES,
    Piece,
    ReadCounters,
    ReadOptions,
    plan_units,
    read_unit,
    resolve_inputs,
)

BOM = codecs.BOM_UTF8
# Unit sizes for the split rule: every small size (so unit boundaries fall on every byte of a
# small file: inside characters, inside "\r\n", on separators) and a few larger ones.
SPLIT_SIZES = [1, 2, 3, 4, 5, 6, 7, 9, 11, 16, 23, 40, 64, 101, 257, 1000]
ASCII_BLANK = re.compile(rb"[ \t\r\x0b\x0c]*")


def write(folder: Path, name: str, data: bytes | str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def read_pieces(patterns: list, options: ReadOptions, target: int = DEFAULT_UNIT_BYTES,
                ) -> tuple[list[Piece], ReadCounters]:
    """Every piece of the corpus, reading the planned units one after another."""
    counters = ReadCounters()
    units = plan_units(resolve_inputs([str(p) for p in patterns]), options, target)
    pieces = [piece for unit in units for piece in read_unit(unit, options, counters)]
    return pieces, counters


def documents(pieces: list[Piece]) -> list[tuple[str, str]]:
    """(source, text) per document, checking that the first/last flags frame each document."""
    out: list[tuple[str, str]] = []
    open_document = False
    for piece in pieces:
        assert piece.first == (not open_document), f"bad first flag at {piece.source}"
        if piece.first:
            out.append((piece.source, piece.text))
        else:
            assert out[-1][0] == piece.source
            out[-1] = (piece.source, out[-1][1] + piece.text)
        open_document = not piece.last
    assert not open_document, "the last document never got its last piece"
    return out


def read_documents(patterns: list, options: ReadOptions, target: int = DEFAULT_UNIT_BYTES,
                   ) -> tuple[list[tuple[str, str]], ReadCounters]:
    pieces, counters = read_pieces(patterns, options, target)
    return documents(pieces), counters


def reference_text_documents(data: bytes, text_format: str, bad_utf8: str = "replace",
                             ) -> list[tuple[int, str]]:
    """(first line number, text) of each document, computed the simple way, all in memory."""
    lines = data.removeprefix(BOM).split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # a final "\n" ends the last line; it does not start another
    lines = [line.removesuffix(b"\r") for line in lines]
    if text_format == "lines":
        groups = [(number, [line]) for number, line in enumerate(lines, 1)]
    else:
        groups, after_blank = [], True
        for number, line in enumerate(lines, 1):
            if ASCII_BLANK.fullmatch(line):
                after_blank = True
            elif after_blank:
                groups.append((number, [line]))
                after_blank = False
            else:
                groups[-1][1].append(line)
    out = []
    for number, group in groups:
        raw = b"\n".join(group)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            if bad_utf8 == "skip":
                continue
            text = raw.decode("utf-8", "replace")
        if text.strip():
            out.append((number, text))
    return out


def tricky_text(seed: int, line_end: bytes) -> bytes:
    """A small plain-text corpus with everything that makes splitting hard."""
    pool = [b"plain ascii line", b"", b"   ", b"\t", b"multi-byte: \xc3\xa9 \xe4\xb8\xad\xe6\x96\x87",
            b"\xf0\x9f\x98\x80" * 9, b"  leading spaces kept", b"trailing spaces   ",
            "\u00a0\u3000".encode(), b"a fairly long line with words " * 3, b"bad \xff byte",
            b"cut \xe2\x82 short", b"lone\rcarriage return", b"x"]
    rng = random.Random(seed)
    lines = [rng.choice(pool) for _ in range(40)]
    data = (BOM if seed % 2 else b"") + line_end.join(lines)
    return data + line_end if seed % 3 else data

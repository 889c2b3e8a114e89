"""Plain text: documents are paragraphs, lines, or the whole file (--text-format)."""

from __future__ import annotations

from typing import Iterable, Iterator

from data_prep.readers.byte_source import ByteSource, without_bom
from data_prep.readers.lines import Line, gather, owned_lines
from data_prep.readers.long_documents import LongDocument, document_bytes
from data_prep.readers.options import ReadOptions
from data_prep.readers.paragraphs import paragraphs
from data_prep.readers.pieces import Piece, ReadCounters, flagged, keep, pieces, split_pieces
from data_prep.readers.planning import WorkUnit
from data_prep.readers.utf8 import decode

__all__ = ["read_text"]


def read_text(source: ByteSource, unit: WorkUnit, options: ReadOptions,
              counters: ReadCounters) -> Iterator[Piece]:
    """The pieces of the plain-text documents that `unit` owns, in file order; fills
    `counters`. Lines lose their line ends; paragraphs join theirs as "\\n"; the whole file
    is kept as is (its byte-order mark left out)."""
    limit = options.max_piece_bytes
    if options.text_format == "file":
        whole_file = gather(0, without_bom(source.blocks(0))[1], limit)
        documents: Iterable[tuple[int, bytes | Line | LongDocument]] = [(1, whole_file)]
    elif options.text_format == "lines":
        documents = owned_lines(source, unit, limit)
    else:
        documents = paragraphs(source, unit, limit)
    for line, document in documents:
        where = f"{unit.file.uri}:{line}"
        if not isinstance(document, bytes):
            yield from _long_pieces(source, document, where, options, counters)
            continue
        try:
            text = document.decode()
        except UnicodeDecodeError:
            text = ""  # not the usual case: pieces() repairs it
        if text and len(document) <= limit and not text.isspace():
            # The usual document, valid and one piece, done inline: this runs once a line or
            # paragraph, and the calls of the general path would add a quarter to its time.
            counters.documents += 1
            counters.utf8_bytes += len(document)
            yield Piece(text, where, True, True)
        else:
            text, bad_utf8 = decode(document)
            yield from pieces(text, document, bad_utf8, where, options, counters)


def _long_pieces(source: ByteSource, document: Line | LongDocument, where: str,
                 options: ReadOptions, counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document that no run of lines holds whole: a long paragraph, checked as
    it passed, or a line longer than a block (in file format: the file)."""
    if isinstance(document, Line):
        document = LongDocument.of(document, options.max_piece_bytes)
        if isinstance(document, bytes):
            text, bad_utf8 = decode(document)
            return pieces(text, document, bad_utf8, where, options, counters)
    if not keep(document.bad_utf8, document.blank, options, counters):
        return ()
    texts = split_pieces(document_bytes(source, document, options.text_format),
                         options.max_piece_bytes)
    return flagged(texts, where, counters)

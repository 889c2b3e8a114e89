"""Plain text: documents are paragraphs, lines, or the whole file (--text-format)."""

from __future__ import annotations

from itertools import compress
from typing import Iterable, Iterator

from data_prep.readers.byte_source import ByteSource, without_bom
from data_prep.readers.lines import Line, WholeDocuments, gather, line_documents
from data_prep.readers.long_documents import LongDocument, document_bytes
from data_prep.readers.options import ReadOptions
from data_prep.readers.paragraphs import paragraphs
from data_prep.readers.pieces import Piece, Pieces, ReadCounters, flagged, keep, pieces, split_pieces
from data_prep.readers.planning import WorkUnit
from data_prep.readers.utf8 import decode

__all__ = ["read_text"]


def read_text(source: ByteSource, unit: WorkUnit, options: ReadOptions,
              counters: ReadCounters) -> Iterator[Piece | Pieces]:
    """The pieces of the plain-text documents that `unit` owns, in file order, one at a time
    or in columns; fills `counters`. Lines lose their line ends; paragraphs join theirs as
    "\\n"; the whole file is kept as is (its byte-order mark left out)."""
    limit = options.max_piece_bytes
    if options.text_format == "file":
        whole_file = gather(0, without_bom(source.blocks(0))[1], limit)
        documents: Iterable[tuple[int, bytes | Line | LongDocument] | WholeDocuments] = [(1, whole_file)]
    elif options.text_format == "lines":
        documents = line_documents(source, unit, limit)
    else:
        documents = paragraphs(source, unit, limit)
    origin = f"{unit.file.uri}:"  # then the number of the document's first line
    for item in documents:
        if isinstance(item, WholeDocuments):
            yield from _whole_document_pieces(item, origin, options, counters)
            continue
        line, document = item
        if isinstance(document, bytes):
            text, bad_utf8 = decode(document)
            yield from pieces(text, document, bad_utf8, origin, line, options, counters)
        else:
            yield from _long_pieces(source, document, origin, line, options, counters)


def _whole_document_pieces(run: WholeDocuments, origin: str, options: ReadOptions,
                           counters: ReadCounters) -> Iterable[Piece | Pieces]:
    """The documents of `run` in columns, the blank ones left out and counted, when all are
    valid UTF-8 and short enough for one piece; else one at a time."""
    try:
        texts = list(map(bytes.decode, run.datas))
    except UnicodeDecodeError:
        return _one_by_one(run, origin, options, counters)
    if max(map(len, run.datas), default=0) > options.max_piece_bytes:
        return _one_by_one(run, origin, options, counters)
    datas, numbers = run.datas, run.numbers
    kept = list(map(bool, map(str.strip, texts)))  # not is_blank(text), for a whole list
    if not all(kept):
        counters.empty_skipped += kept.count(False)
        texts, datas, numbers = (list(compress(column, kept)) for column in (texts, datas, numbers))
    columns = Pieces.whole_documents(origin, texts, datas, numbers)
    counters.documents += len(columns)
    counters.utf8_bytes += columns.utf8_bytes
    return (columns,) if columns else ()


def _one_by_one(run: WholeDocuments, origin: str, options: ReadOptions,
                counters: ReadCounters) -> Iterator[Piece]:
    for number, data in zip(run.numbers, run.datas):
        text, bad_utf8 = decode(data)
        yield from pieces(text, data, bad_utf8, origin, number, options, counters)


def _long_pieces(source: ByteSource, document: Line | LongDocument, origin: str, number: int,
                 options: ReadOptions, counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document that no run of lines holds whole: a long paragraph, checked as
    it passed, or a line longer than a block (in file format: the file)."""
    if isinstance(document, Line):
        document = LongDocument.of(document, options.max_piece_bytes)
        if isinstance(document, bytes):
            text, bad_utf8 = decode(document)
            return pieces(text, document, bad_utf8, origin, number, options, counters)
    if not keep(document.bad_utf8, document.blank, options, counters):
        return ()
    texts = split_pieces(document_bytes(source, document, options.text_format),
                         options.max_piece_bytes)
    return flagged(texts, origin, number, counters)

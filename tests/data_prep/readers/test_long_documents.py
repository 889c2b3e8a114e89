"""Huge documents in bounded memory (``data_prep.readers.long_documents``): a document no run of
lines holds whole streams in pieces of bounded size, and one with a late bad byte is skipped (or
repaired) whole, before any of its pieces goes out."""

import gzip
import hashlib
import tracemalloc

import pytest

from data_prep.readers import (
    ReadCounters,
    ReadOptions,
    WorkUnit,
    read_unit,
    resolve_inputs,
)
from tests.support.readers import (
    documents,
    read_pieces,
    reference_text_documents,
    write,
)


@pytest.mark.parametrize("text_format", ["lines", "paragraphs", "file"])
@pytest.mark.parametrize("compressed", [False, True])
def test_a_long_document_with_a_late_bad_byte(tmp_path, text_format, compressed):
    line_end = " " if text_format == "lines" else "\n"  # one long line, or many lines
    long_document = f"many words on many lines{line_end}" * 200
    data = f"before\n\n{long_document}".encode() + b"\xff\n\nafter\n"
    path = write(tmp_path, "a.txt.gz" if compressed else "a.txt",
                 gzip.compress(data) if compressed else data)
    for bad_utf8, dropped, repaired in [("skip", 1, 0), ("replace", 0, 1)]:
        options = ReadOptions(text_format=text_format, bad_utf8=bad_utf8, max_piece_bytes=64)
        pieces, counters = read_pieces([path], options)
        if text_format == "file":
            expected = [] if bad_utf8 == "skip" else [data.decode("utf-8", "replace")]
        else:
            expected = [text for _, text in reference_text_documents(data, text_format, bad_utf8)]
        # With skip, not one piece of the long document: it is checked before it is cut.
        assert [text for _, text in documents(pieces)] == expected
        assert (counters.bad_utf8_skipped, counters.bad_utf8_repaired) == (dropped, repaired)


@pytest.mark.parametrize("text_format", ["lines", "paragraphs", "file"])
def test_a_huge_document_streams_in_bounded_memory(tmp_path, text_format):
    limit, size = 64 << 10, 32 << 20
    line = "streaming words \u00fcn\u00efc\u00f6d\u00e9 \u6587\u5b57 " * 30
    separator = " " if text_format == "lines" else "\n"
    document = separator.join([line] * (size // len(line.encode()))).encode()
    path = write(tmp_path, "huge.txt", document + b"\n")
    expected = hashlib.sha256(document + (b"\n" if text_format == "file" else b"")).hexdigest()
    unit = WorkUnit(0, resolve_inputs([str(path)])[0], 0, path.stat().st_size)
    options = ReadOptions(text_format=text_format, bad_utf8="skip", max_piece_bytes=limit)
    digest, pieces = hashlib.sha256(), 0
    tracemalloc.start()
    try:
        for piece in read_unit(unit, options, ReadCounters()):
            encoded = piece.text.encode()
            assert len(encoded) <= limit
            digest.update(encoded)
            pieces += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest.hexdigest() == expected
    assert pieces >= size // limit
    assert peak < size // 4, f"peak {peak >> 20} MiB for a {size >> 20} MiB document"

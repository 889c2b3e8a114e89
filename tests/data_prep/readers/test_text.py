"""Plain text (``data_prep.readers.text``, with ``lines`` and ``paragraphs`` below it): documents
are paragraphs, lines or the whole file; real corpora read as a plain split would read them;
CRLF and paragraph ends cut by a read block."""

import re

from data_prep.readers import (
    DEFAULT_PIECE_BYTES,
    READ_BLOCK_BYTES,
    ReadOptions,
)
from tests.support.paths import require_shared
from tests.support.readers import (
    BOM,
    documents,
    read_documents,
    read_pieces,
    reference_text_documents,
    write,
)


def test_ptb_lines_round_trip():
    path = require_shared("ptb/ptb.test.txt")
    docs, counters = read_documents([path], ReadOptions(text_format="lines"))
    text = path.read_text()
    assert len(docs) == counters.documents == 3761
    assert "\n".join(doc for _, doc in docs) == text.removesuffix("\n")
    assert [source for source, _ in docs] == [f"{path}:{n}" for n in range(1, 3762)]
    assert counters.utf8_bytes == len(text.encode()) - 3761  # every byte but the newlines


def test_tinyshakespeare_paragraphs_match_a_blank_line_split():
    path = require_shared("corpora/tinyshakespeare/input.txt")
    docs, counters = read_documents([path], ReadOptions())
    expected = re.split(r"\n\s*\n", path.read_text().strip())
    assert [doc for _, doc in docs] == expected
    assert counters.documents == len(expected)
    # Units that start mid-file give the same documents, line numbers included.
    for target in (65_537, 300_007):
        assert read_documents([path], ReadOptions(), target) == (docs, counters)


def test_wikitext_whitespace_lines_are_empty_documents():
    path = require_shared("wikitext-2-raw/wiki.test.raw")
    lines = path.read_text().removesuffix("\n").split("\n")
    blank = sum(not line.strip() for line in lines)
    docs, counters = read_documents([path], ReadOptions(text_format="lines"), target=200_003)
    assert counters.empty_skipped == blank
    assert [doc for _, doc in docs] == [line for line in lines if line.strip()]


def test_paragraphs_lines_and_file_formats(tmp_path):
    data = BOM + b"First para\r\n  indented line\r\n\r\n \t \r\nSecond\r\n\r\n\r\nThird\r\nlast"
    path = write(tmp_path, "a.txt", data)
    paragraphs, _ = read_documents([path], ReadOptions())
    assert paragraphs == [(f"{path}:1", "First para\n  indented line"), (f"{path}:5", "Second"),
                          (f"{path}:8", "Third\nlast")]
    lines, counters = read_documents([path], ReadOptions(text_format="lines"))
    assert [text for _, text in lines] == ["First para", "  indented line", "Second", "Third",
                                           "last"]
    assert counters.empty_skipped == 4
    whole, _ = read_documents([path], ReadOptions(text_format="file"))
    assert whole == [(f"{path}:1", data.removeprefix(BOM).decode())]


def test_crlf_split_across_read_blocks(tmp_path):
    # The "\r" is the last byte of the first block read, its "\n" the first of the next.
    long_line = "a" * (READ_BLOCK_BYTES - 1)
    path = write(tmp_path, "a.txt", f"{long_line}\r\nnext\r\n")
    docs, _ = read_documents([path], ReadOptions(text_format="lines"))
    assert docs == [(f"{path}:1", long_line), (f"{path}:2", "next")]


def test_paragraph_ends_cut_by_a_read_block_boundary(tmp_path):
    # Read blocks end between any two bytes of a blank-line separator, in the same paragraph or
    # the next, with paragraphs held whole or cut into pieces, in units split near the cut.
    line, separator = b"a line of words\r\n", b"\r\n \t\r\n\r\n"
    lines = line * (READ_BLOCK_BYTES // len(line) - 1)
    for shift in range(-2, len(separator) + 3):  # where the block ends, from the separator
        padding = b"y" * (READ_BLOCK_BYTES - shift - len(lines))
        data = lines + padding + separator + b"next paragraph\r\n \r\n\tand its\r\nlines"
        path = write(tmp_path, f"shift{shift}.txt", data)
        expected = [(f"{path}:{n}", text)
                    for n, text in reference_text_documents(data, "paragraphs")]
        for max_piece_bytes in (4096, DEFAULT_PIECE_BYTES):
            options = ReadOptions(max_piece_bytes=max_piece_bytes)
            whole, counters = read_pieces([path], options)
            assert documents(whole) == expected, (shift, max_piece_bytes)
            target = READ_BLOCK_BYTES - shift + 1
            assert read_pieces([path], options, target) == (whole, counters), shift

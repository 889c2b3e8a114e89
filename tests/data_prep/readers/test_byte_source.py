"""The bytes of a file (``data_prep.readers.byte_source``): gzip read like the plain file (and
damaged gzip named), the byte-order mark dropped, binary files skipped whole and counted once."""

import gzip
import re
from pathlib import Path

import pytest

from common.errors import UserError
from data_prep import readers
from data_prep.readers import (
    ReadOptions,
    plan_units,
    resolve_inputs,
)
from tests.support.readers import (
    BOM,
    SPLIT_SIZES,
    read_documents,
    read_pieces,
    tricky_text,
    write,
)


def test_gzip_text_reads_like_the_plain_file(tmp_path):
    data = tricky_text(1, b"\r\n")
    plain = write(tmp_path, "a.txt", data)
    packed = write(tmp_path, "a.txt.gz", gzip.compress(data))
    options = ReadOptions(max_piece_bytes=8)
    [unit] = plan_units(resolve_inputs([str(packed)]), options, 3)
    assert (unit.start, unit.end) == (0, packed.stat().st_size)
    plain_docs, plain_counters = read_documents([plain], options)
    packed_docs, packed_counters = read_documents([packed], options, target=3)
    assert [(s.replace(".gz", ""), t) for s, t in packed_docs] == plain_docs
    assert packed_counters == plain_counters


@pytest.mark.parametrize("damage", [lambda data: b"not gzip at all",
                                    lambda data: data[: len(data) // 2]])
def test_corrupt_gzip_names_the_file(tmp_path, damage):
    path = write(tmp_path, "a.txt.gz", damage(gzip.compress(b"hello world\n" * 1000)))
    with pytest.raises(UserError, match=re.escape(str(path)) + ".*gzip"):
        read_documents([path], ReadOptions())


def test_byte_order_mark_is_dropped(tmp_path):
    mark_line = write(tmp_path, "a.txt", BOM + b"\nhello\n")  # the first line is blank
    jsonl = write(tmp_path, "b.jsonl", BOM + b'{"text": "hi"}\n')
    for target in SPLIT_SIZES[:6]:
        assert read_documents([mark_line], ReadOptions(), target)[0] == [(f"{mark_line}:2", "hello")]
    whole_file, _ = read_documents([mark_line], ReadOptions(text_format="file"))
    assert whole_file == [(f"{mark_line}:1", "\nhello\n")]
    assert read_documents([jsonl], ReadOptions())[0] == [(f"{jsonl}:1", "hi")]


def test_binary_files_are_skipped_whole_and_counted_once(tmp_path):
    text = "a paragraph\n\nanother one\n"
    binary = bytes(range(256)) * 40  # NUL in the first block, as in an executable or an image
    paths = [write(tmp_path, "a.txt", text), write(tmp_path, "b", binary),
             write(tmp_path, "c.jsonl.gz", gzip.compress(b'{"text": "x"}\n\0\n')),
             write(tmp_path, "d.txt", "hello\n\nworld\n".encode("utf-16")),   # with a byte-order mark
             write(tmp_path, "e.txt", binary[:1] + b"x" * readers.BINARY_CHECK_BYTES)]  # NUL first
    pieces, counters = read_pieces(paths, ReadOptions(), target=1000)  # the binary file makes 11 units
    assert [p.text for p in pieces] == ["a paragraph", "another one"]
    assert counters.binary_files_skipped == 4 and counters.documents == 2
    reasons = {Path(file.uri).name: readers.binary_reason(file) for file in resolve_inputs([str(p) for p in paths])}
    assert reasons["a.txt"] is None and "UTF-16 text (byte-order mark)" in reasons["d.txt"]
    assert "NUL bytes in its first 8000 bytes" in reasons["b"] and reasons["c.jsonl.gz"] and reasons["e.txt"]
    # A NUL past the first block does not make a file binary (git and grep look no further).
    late = write(tmp_path, "late.txt", "x" * readers.BINARY_CHECK_BYTES + "\0 tail\n")
    assert readers.binary_reason(resolve_inputs([str(late)])[0]) is None

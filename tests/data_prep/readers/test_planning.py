"""Work-unit planning (``data_prep.readers.planning``) and the split rule: the units of a file, read
one after another, give exactly the documents of the file read whole, wherever the unit boundaries
fall (inside characters, inside "\\r\\n", inside lines longer than a read block)."""

import json
import random

import pytest

from data_prep.readers import (
    DEFAULT_PIECE_BYTES,
    READ_BLOCK_BYTES,
    InputFile,
    ReadOptions,
    WorkUnit,
    plan_units,
    resolve_inputs,
)
from tests.support.readers import (
    BOM,
    SPLIT_SIZES,
    documents,
    read_pieces,
    reference_text_documents,
    tricky_text,
    write,
)


@pytest.mark.parametrize("text_format", ["lines", "paragraphs"])
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"])
@pytest.mark.parametrize("max_piece_bytes", [8, DEFAULT_PIECE_BYTES])
def test_text_units_concatenate_to_the_whole_file(tmp_path, text_format, line_end,
                                                  max_piece_bytes):
    options = ReadOptions(text_format=text_format, max_piece_bytes=max_piece_bytes)
    for seed in range(3):
        data = tricky_text(seed, line_end)
        path = write(tmp_path, f"corpus{seed}.txt", data)
        whole, counters = read_pieces([path], options)
        expected = reference_text_documents(data, text_format)
        assert documents(whole) == [(f"{path}:{n}", text) for n, text in expected]
        for target in SPLIT_SIZES:
            units = plan_units(resolve_inputs([str(path)]), options, target)
            assert len(units) == -(-len(data) // target)
            assert read_pieces([path], options, target) == (whole, counters), (seed, target)


def test_jsonl_units_concatenate_to_the_whole_file(tmp_path):
    texts = ["plain", "multi\nline \u00e9 \u4e2d \U0001F600", "  spaced  ", "", "x" * 50, "tab\there"]
    rng = random.Random(0)
    lines = [json.dumps({"id": i, "text": rng.choice(texts)}, ensure_ascii=bool(i % 2)).encode()
             for i in range(30)]
    lines[7] = b""  # blank lines are allowed
    lines[9] = b'{"text": "bad \xff byte"}'
    data = BOM + b"\r\n".join(lines) + b"\r\n"
    path = write(tmp_path, "a.jsonl", data)
    options = ReadOptions(max_piece_bytes=8)
    whole, counters = read_pieces([path], options)
    assert counters.bad_utf8_repaired == 1 and counters.empty_skipped == sum(
        json.loads(line)["text"].strip() == "" for line in lines if line and b"\xff" not in line)
    for target in SPLIT_SIZES:
        assert read_pieces([path], options, target) == (whole, counters), f"target {target}"


def test_units_split_inside_lines_longer_than_a_block(tmp_path):
    long_line = "word " * (READ_BLOCK_BYTES // 2)  # 2.5 MiB: read in several fragments
    data = f"short\r\n\r\n{long_line}\r\nnext line\r\n\r\n{long_line}x\r\n".encode()
    path = write(tmp_path, "a.txt", data)
    for text_format in ("lines", "paragraphs"):
        options = ReadOptions(text_format=text_format, max_piece_bytes=64 << 10)
        whole, counters = read_pieces([path], options)
        expected = reference_text_documents(data, text_format)
        assert documents(whole) == [(f"{path}:{n}", text) for n, text in expected]
        for target in (READ_BLOCK_BYTES - 1, 700_001, 2 * READ_BLOCK_BYTES + 5):
            assert read_pieces([path], options, target) == (whole, counters), target


def test_file_format_is_one_unit(tmp_path):
    path = write(tmp_path, "a.txt", "one document\n\nover blank lines\n" * 50)
    [file] = resolve_inputs([str(path)])
    assert plan_units([file], ReadOptions(text_format="file"), 10) == [WorkUnit(0, file, 0, file.size)]
    assert len(plan_units([file], ReadOptions(text_format="lines"), 10)) == -(-file.size // 10)
    assert plan_units([InputFile(str(path), "text", None, 0)], ReadOptions(), 10) == []

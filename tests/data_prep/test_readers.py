"""Corpus readers: input resolution, planning, every format, the split rule, bad input, streaming."""

import codecs
import gzip
import hashlib
import json
import random
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from data_prep import readers
from data_prep.readers import (
    DEFAULT_PIECE_BYTES,
    DEFAULT_UNIT_BYTES,
    READ_BLOCK_BYTES,
    InputFile,
    Piece,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    jsonl,
    plan_units,
    read_unit,
    resolve_inputs,
)
from tests.support.paths import require_shared

BOM = codecs.BOM_UTF8
# Unit sizes for the split rule: every small size (so unit boundaries fall on every byte of a
# small file: inside characters, inside "\r\n", on separators) and a few larger ones.
SPLIT_SIZES = [1, 2, 3, 4, 5, 6, 7, 9, 11, 16, 23, 40, 64, 101, 257, 1000]
ASCII_BLANK = re.compile(rb"[ \t\r\x0b\x0c]*")


# ---------------------------------------------------------------- helpers
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


# ---------------------------------------------------------------- real corpora
def test_ptb_lines_round_trip():
    path = require_shared("ptb/ptb.test.txt")
    docs, counters = read_documents([path], ReadOptions(text_format="lines"))
    text = path.read_text()
    assert len(docs) == counters.documents == 3761
    assert "\n".join(doc for _, doc in docs) == text.removesuffix("\n")
    assert [source for source, _ in docs] == [f"{path}:{n}" for n in range(1, 3762)]
    assert counters.utf8_bytes == len(text.encode()) - 3761  # every byte but the newlines


def test_lambada_jsonl_gives_every_record():
    path = require_shared("lambada/lambada_test.jsonl")
    docs, counters = read_documents([path], ReadOptions())
    expected = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert counters.documents == len(docs) == 5153
    assert [doc for _, doc in docs] == expected
    assert docs[41][0] == f"{path}:42"


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


def test_lm1b_shard_without_extension_is_text():
    path = require_shared("lm1b/news.en.heldout-00000-of-00050")
    [file] = resolve_inputs([str(path.parent)])
    assert (file.uri, file.format, file.compression) == (str(path), "text", None)
    _, counters = read_documents([path], ReadOptions(text_format="lines"))
    assert counters.documents == 6075


# ---------------------------------------------------------------- resolving inputs
@pytest.mark.parametrize("name, file_format, compression", [
    ("a.txt", "text", None), ("a.TEXT", "text", None), ("wiki.test.raw", "text", None),
    ("wiki.test.tokens", "text", None), ("README", "text", None), ("a.txt.gz", "text", "gzip"),
    ("a.gz", "text", "gzip"), ("news.en.heldout-00000-of-00050", "text", None),
    ("part.00001", "text", None), ("a.jsonl", "jsonl", None), ("a.json.gz", "jsonl", "gzip"),
    ("a.parquet", "parquet", None),
])
def test_format_comes_from_the_name(tmp_path, name, file_format, compression):
    [file] = resolve_inputs([str(write(tmp_path, name, "x"))])
    assert (file.format, file.compression, file.size) == (file_format, compression, 1)


@pytest.mark.parametrize("name", ["data.csv", "notes.md", "dump.tar.gz", "text.bz2", "x.zst"])
def test_unknown_extension_is_an_error_naming_the_file(tmp_path, name):
    path = write(tmp_path, name, "x")
    with pytest.raises(UserError, match=re.escape(str(path)) + ".*unknown file type.*\\.jsonl"):
        resolve_inputs([str(path)])


def test_gzipped_parquet_is_an_error(tmp_path):
    path = write(tmp_path, "a.parquet.gz", "x")
    with pytest.raises(UserError, match=re.escape(str(path)) + ".*Parquet"):
        resolve_inputs([str(path)])


def test_directories_globs_and_file_uris(tmp_path, monkeypatch):
    for name in ["a.txt", "sub/b.jsonl", "sub/deeper/c.txt.gz", "sub/deeper/d1.txt",
                 ".hidden.txt", "sub/.git/e.txt", "other/f.txt"]:
        write(tmp_path / "corpus", name, "x")
    root = tmp_path / "corpus"
    everything = sorted(str(root / name) for name in
                        ["a.txt", "sub/b.jsonl", "sub/deeper/c.txt.gz", "sub/deeper/d1.txt",
                         "other/f.txt"])

    def uris(*patterns: str) -> list[str]:
        return [file.uri for file in resolve_inputs(list(patterns))]

    assert uris(str(root)) == everything
    assert uris(f"file://{root}") == everything
    text_files = [str(root / name) for name in ["a.txt", "other/f.txt", "sub/deeper/d1.txt"]]
    assert uris(f"{root}/**/*.txt") == uris(f"file://{root}/**/*.txt") == text_files
    assert uris(f"{root}/*/deeper/[cd]?.txt*") == [str(root / "sub/deeper/d1.txt")]
    assert uris(f"{root}/sub/**") == [name for name in everything if "/sub/" in name]
    # Overlapping patterns give each file once, sorted; relative paths become absolute.
    monkeypatch.chdir(root)
    assert uris("other/f.txt", f"{root}/other", "*.txt", "a.txt") == text_files[:2]


def test_missing_inputs_name_the_pattern(tmp_path):
    (tmp_path / "empty").mkdir()
    write(tmp_path, "only_hidden/.x.txt", "x")
    for pattern in [tmp_path / "nope.txt", tmp_path / "empty", tmp_path / "only_hidden",
                    f"{tmp_path}/*.jsonl", f"{tmp_path}/missing_dir/**/*.txt"]:
        with pytest.raises(UserError, match=re.escape(str(pattern))):
            resolve_inputs([str(pattern)])
    with pytest.raises(UserError, match="no inputs"):
        resolve_inputs([])


# ---------------------------------------------------------------- plain text
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


def test_long_documents_are_cut_at_newlines_spaces_or_characters(tmp_path):
    lines = [f"line number {i}" for i in range(5)]  # 13 bytes: a line and its "\n" fit in 16
    words = "some words and more words " * 4
    characters = "\u20ac" * 40  # 3 bytes each, no space: cuts must fall between characters
    path = write(tmp_path, "a.txt", "\n".join(lines) + f"\n\n{words}\n\n{characters}\n")
    pieces, _ = read_pieces([path], ReadOptions(max_piece_bytes=16))
    assert [text for _, text in documents(pieces)] == ["\n".join(lines), words, characters]
    by_line = {}
    for piece in pieces:
        by_line.setdefault(piece.source, []).append(piece.text)
    by_newline, by_space, by_character = by_line.values()
    assert by_newline == [line + "\n" for line in lines[:-1]] + [lines[-1]]
    assert all(text.endswith(" ") and len(text.encode()) <= 16 for text in by_space)
    assert by_character == ["\u20ac" * 5] * 8


# ---------------------------------------------------------------- bad UTF-8 and empty documents
def test_bad_utf8_is_repaired_or_skips_the_document(tmp_path):
    path = write(tmp_path, "a.txt", b"good\nbad \xff here\ncut \xe2\x82\nalso good\n")
    repaired, counters = read_documents([path], ReadOptions(text_format="lines"))
    assert [text for _, text in repaired] == ["good", "bad \ufffd here", "cut \ufffd", "also good"]
    assert (counters.bad_utf8_repaired, counters.bad_utf8_skipped) == (2, 0)
    assert counters.utf8_bytes == sum(len(text.encode()) for _, text in repaired)
    kept, counters = read_documents([path], ReadOptions(text_format="lines", bad_utf8="skip"))
    assert kept == [(f"{path}:1", "good"), (f"{path}:4", "also good")]
    assert (counters.documents, counters.bad_utf8_repaired, counters.bad_utf8_skipped) == (2, 0, 2)


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


def test_empty_documents_are_skipped_and_counted(tmp_path):
    text = write(tmp_path, "a.txt", "x\n \n\t\n\u3000\n\ny\n")
    jsonl = write(tmp_path, "a.jsonl", '{"text": ""}\n\n{"text": "  "}\n{"text": "z"}\n')
    blank_file = write(tmp_path, "blank.txt", " \n\n")
    for path, options, kept, empty in [
        (text, ReadOptions(text_format="lines"), 2, 4),
        (text, ReadOptions(), 2, 1),  # the U+3000 line is a paragraph of only whitespace
        (jsonl, ReadOptions(), 1, 2),
        (blank_file, ReadOptions(text_format="file"), 0, 1),
    ]:
        _, counters = read_documents([path], options)
        assert (counters.documents, counters.empty_skipped) == (kept, empty), (path, options)


# ---------------------------------------------------------------- JSONL
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


@pytest.mark.parametrize("line, problem", [
    ("not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object, got an array"),
    ('{"body": "x"}', "no field 'text' \\(fields: 'body'\\); choose one with --text-field"),
    ('{"text": 3}', "field 'text' is a number, not a string; .*--text-field"),
    ('{"text": null}', "field 'text' is null"),
])
def test_bad_json_lines_stop_with_the_line_or_are_skipped(tmp_path, line, problem):
    path = write(tmp_path, "a.jsonl", f'{{"text": "a"}}\n\n{{"text": "b"}}\n{line}\n{{"text": "c"}}\n')
    for target in (DEFAULT_UNIT_BYTES, 7):  # units that start mid-file number lines right
        with pytest.raises(UserError, match=re.escape(f"{path}:4: ") + problem + ".*--bad-json skip"):
            read_pieces([path], ReadOptions(), target)
    docs, counters = read_documents([path], ReadOptions(bad_json="skip"), 7)
    assert [text for _, text in docs] == ["a", "b", "c"]
    assert counters.bad_json_skipped == 1


def test_jsonl_lines_parse_as_json_loads_parses_them(tmp_path):
    # Whitespace around the object is allowed; a second value, or a U+FEFF that starts a line
    # (not the file), is an error that json.loads names.
    good = '  {"text": "a"}\t \n'
    bad = ['{"text": "b"} {"x": 1}', '\ufeff{"text": "c"}', '{"text": "d"', '{"text": "e']
    path = write(tmp_path, "a.jsonl", good + "\n".join(bad) + "\n")
    docs, counters = read_documents([path], ReadOptions(bad_json="skip"))
    assert docs == [(f"{path}:1", "a")] and counters.bad_json_skipped == 4
    for index, line in enumerate(bad):
        path = write(tmp_path, f"{index}.jsonl", good + line + "\n")
        with pytest.raises(json.JSONDecodeError) as error:
            json.loads(line)
        problem = f"{path}:2: not valid JSON ({error.value.msg.removesuffix(' at')} at column {error.value.colno})"
        with pytest.raises(UserError, match=re.escape(problem)):
            read_pieces([path], ReadOptions())
    # json's "Unterminated string starting at" once said "at at column 10".
    with pytest.raises(UserError, match=re.escape("(Unterminated string starting at column 10)")):
        read_pieces([path], ReadOptions())


def test_jsonl_bad_utf8_counts_only_in_the_text_field(tmp_path):
    path = write(tmp_path, "a.jsonl", b'{"url": "\xff", "text": "fine"}\n{"text": "bad \xfe"}\n'
                                      b'{"text": "escaped \\ud800 surrogate"}\n')
    docs, counters = read_documents([path], ReadOptions())
    assert [text for _, text in docs] == ["fine", "bad \ufffd", "escaped \ufffd surrogate"]
    assert counters.bad_utf8_repaired == 2
    docs, counters = read_documents([path], ReadOptions(bad_utf8="skip", text_field="text"))
    assert [text for _, text in docs] == ["fine"] and counters.bad_utf8_skipped == 2


def test_a_json_array_on_one_line_fails_before_filling_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_JSONL_LINE_BYTES", 1 << 20)
    records = json.dumps([{"text": "x" * 100}] * 20_000)  # 2 MiB on one line
    path = write(tmp_path, "dump.json", records + "\n")
    with pytest.raises(UserError, match=re.escape(f"{path}:1: line longer than 1 MiB")):
        read_pieces([path], ReadOptions())
    _, counters = read_pieces([path], ReadOptions(bad_json="skip"))
    assert counters.bad_json_skipped == 1


def test_jsonl_with_another_text_field(tmp_path):
    path = write(tmp_path, "a.json.gz", gzip.compress(b'{"body": "hello", "text": 1}\n'))
    assert read_documents([path], ReadOptions(text_field="body"))[0] == [(f"{path}:1", "hello")]


# ---------------------------------------------------------------- Parquet
def write_parquet(folder: Path, values: list, row_group_size: int) -> Path:
    path = folder / "a.parquet"
    pq.write_table(pa.table({"id": list(range(len(values))), "text": values}), path,
                   row_group_size=row_group_size)
    return path


def test_parquet_row_groups_make_units(tmp_path):
    values = [f"document {i} " * (i % 7) if i % 11 else None for i in range(100)]
    values[5] = "long " * 30
    path = write_parquet(tmp_path, values, row_group_size=10)
    options = ReadOptions(max_piece_bytes=16)
    units = plan_units(resolve_inputs([str(path)]), options, target_unit_bytes=1000)
    assert len(units) in range(2, 10) and units[0].start == 0 and units[-1].end == 10
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    whole, counters = read_pieces([path], options)
    assert read_pieces([path], options, 1000) == (whole, counters)
    assert read_pieces([path], options, 1) == (whole, counters)  # one row group per unit
    expected = [(f"{path}#row={i}", v) for i, v in enumerate(values) if v and v.strip()]
    assert documents(whole) == expected
    assert counters.empty_skipped == 100 - len(expected)
    assert max(len(piece.text.encode()) for piece in whole) <= 16


def test_parquet_bad_utf8_and_missing_or_wrong_column(tmp_path):
    broken = pa.array([b"ok", b"bad \xff"], pa.binary()).view(pa.string())  # unchecked on write
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": broken, "n": [1, 2]}), path)
    docs, counters = read_documents([path], ReadOptions(text_column="body"))
    assert [text for _, text in docs] == ["ok", "bad \ufffd"] and counters.bad_utf8_repaired == 1
    missing = re.escape(str(path)) + ".*'text'.*body, n.*--text-column"
    with pytest.raises(UserError, match=missing):
        plan_units(resolve_inputs([str(path)]), ReadOptions())
    with pytest.raises(UserError, match=missing):  # a unit planned with another --text-column
        unit = plan_units(resolve_inputs([str(path)]), ReadOptions(text_column="body"))[0]
        list(read_unit(unit, ReadOptions(), ReadCounters()))
    with pytest.raises(UserError, match="column 'n' holds int64, not text.*--text-column"):
        read_documents([path], ReadOptions(text_column="n"))


# ---------------------------------------------------------------- streaming
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


# ---------------------------------------------------------------- options and counters
@pytest.mark.parametrize("field, value, flag", [
    ("text_format", "markdown", "--text-format"), ("bad_utf8", "ignore", "--bad-utf8"),
    ("bad_json", "warn", "--bad-json"), ("max_piece_bytes", 3, "max_piece_bytes"),
])
def test_bad_options_name_the_flag(field, value, flag):
    with pytest.raises(UserError, match=flag):
        ReadOptions(**{field: value})


def test_counters_add_up():
    total = ReadCounters(documents=2, utf8_bytes=10) + ReadCounters(documents=1, bad_json_skipped=4)
    assert total.to_dict() == {"documents": 3, "utf8_bytes": 10, "empty_skipped": 0, "bad_utf8_repaired": 0,
                               "bad_utf8_skipped": 0, "bad_json_skipped": 4, "binary_files_skipped": 0}
    assert sum([ReadCounters(documents=1)] * 3, ReadCounters()).documents == 3


def test_file_format_is_one_unit(tmp_path):
    path = write(tmp_path, "a.txt", "one document\n\nover blank lines\n" * 50)
    [file] = resolve_inputs([str(path)])
    assert plan_units([file], ReadOptions(text_format="file"), 10) == [WorkUnit(0, file, 0, file.size)]
    assert len(plan_units([file], ReadOptions(text_format="lines"), 10)) == -(-file.size // 10)
    assert plan_units([InputFile(str(path), "text", None, 0)], ReadOptions(), 10) == []

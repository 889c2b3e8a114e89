"""Documents to pieces (``data_prep.readers.pieces``): which documents are kept (empty ones and, per
--bad-utf8, invalid ones are not), what is counted, and where a long document is cut."""

from data_prep.readers import (
    ReadCounters,
    ReadOptions,
)
from tests.support.readers import (
    documents,
    read_documents,
    read_pieces,
    write,
)


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


def test_bad_utf8_is_repaired_or_skips_the_document(tmp_path):
    path = write(tmp_path, "a.txt", b"good\nbad \xff here\ncut \xe2\x82\nalso good\n")
    repaired, counters = read_documents([path], ReadOptions(text_format="lines"))
    assert [text for _, text in repaired] == ["good", "bad \ufffd here", "cut \ufffd", "also good"]
    assert (counters.bad_utf8_repaired, counters.bad_utf8_skipped) == (2, 0)
    assert counters.utf8_bytes == sum(len(text.encode()) for _, text in repaired)
    kept, counters = read_documents([path], ReadOptions(text_format="lines", bad_utf8="skip"))
    assert kept == [(f"{path}:1", "good"), (f"{path}:4", "also good")]
    assert (counters.documents, counters.bad_utf8_repaired, counters.bad_utf8_skipped) == (2, 0, 2)


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


def test_counters_add_up():
    total = ReadCounters(documents=2, utf8_bytes=10) + ReadCounters(documents=1, bad_json_skipped=4)
    assert total.to_dict() == {"documents": 3, "utf8_bytes": 10, "empty_skipped": 0, "bad_utf8_repaired": 0,
                               "bad_utf8_skipped": 0, "bad_json_skipped": 4, "binary_files_skipped": 0}
    assert sum([ReadCounters(documents=1)] * 3, ReadCounters()).documents == 3

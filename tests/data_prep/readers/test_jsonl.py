"""JSON lines (``data_prep.readers.jsonl``): every record of a real file, lines parsed as json.loads
parses them, bad lines named by file and line (or skipped with --bad-json skip), bad UTF-8 counted
in the text field only, another --text-field."""

import gzip
import json
import re

import pytest

from common.errors import UserError
from data_prep.readers import (
    DEFAULT_UNIT_BYTES,
    ReadOptions,
    jsonl,
)
from tests.support.paths import require_shared
from tests.support.readers import (
    read_documents,
    read_pieces,
    write,
)


def test_lambada_jsonl_gives_every_record():
    path = require_shared("lambada/lambada_test.jsonl")
    docs, counters = read_documents([path], ReadOptions())
    expected = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert counters.documents == len(docs) == 5153
    assert [doc for _, doc in docs] == expected
    assert docs[41][0] == f"{path}:42"


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

"""Input resolution (``data_prep.readers.inputs``): the files that --input patterns name (paths,
globs, file URIs, directories), each file's format and compression from its name, and the patterns
that name nothing."""

import os
import re

import pytest

from common.errors import UserError
from data_prep.readers import (
    ReadOptions,
    resolve_inputs,
)
from tests.support.paths import require_shared
from tests.support.readers import (
    read_documents,
    write,
)


def test_lm1b_shard_without_extension_is_text():
    path = require_shared("lm1b/news.en.heldout-00000-of-00050")
    [file] = resolve_inputs([str(path.parent)])
    assert (file.uri, file.format, file.compression) == (str(path), "text", None)
    _, counters = read_documents([path], ReadOptions(text_format="lines"))
    assert counters.documents == 6075


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


def test_a_device_or_a_fifo_as_input_is_named_for_what_it_is(tmp_path):
    """`prep --input /dev/zero` said "no such file": it is there, and is no file."""
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    for pattern, kind in (("/dev/zero", "a character device"), (str(fifo), r"a FIFO \(named pipe\)")):
        with pytest.raises(UserError, match=rf"^{re.escape(pattern)}: is {kind}, not a file or a directory; prep "
                                            r"reads its inputs by byte ranges, some twice: save what it gives to a "
                                            r"file and give that file$"):
            resolve_inputs([pattern])

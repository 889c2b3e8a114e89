"""The file formats the zero-shot sets come in, read into raw text units (before detokenizing).

    text = decode_utf8(path, path.read_bytes())
    ag_news_csv(path, text)               # AG News's CSV: "title description" per row, as HF joins them
    scientific_papers_jsonl(path, text)   # the release's val.txt / test.txt: each article_text joined by "\\n"
    parquet_strings(path, "article", "the Hugging Face scientific_papers split")

Each reader returns the units in file order and refuses what it cannot read in one line naming
the file, the line (or row) and the format it expected (``common.errors.UserError``). The units
are those of the Hugging Face builders the papers' code loads (``ag_news``, ``scientific_papers``),
so a parquet of the Hugging Face split and the release's own file give the same units. Which file
of which set: ``evaluation.bounds.datasets``; the formats: docs/evaluation.md#the-data-directory.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError, json_problem
from data_prep.readers.lines import is_blank_line

__all__ = ["AG_NEWS_FIELDS", "ag_news_csv", "decode_utf8", "jsonl_strings", "lines", "paragraphs",
           "parquet_strings", "scientific_papers_jsonl"]

AG_NEWS_FIELDS = ("class index", "title", "description")
AG_NEWS_CLASSES = range(1, 5)  # World, Sports, Business, Sci/Tech
ARTICLE_TEXT = "article_text"  # the release's field: the article's sentences, in order


def decode_utf8(path: Path, data: bytes) -> str:
    """``data`` (the bytes of ``path``) as text; a UTF-8 byte-order mark is dropped."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"{path} line {line}: byte {err.start} is not UTF-8 ({err.reason}); "
                        f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def lines(text: str) -> list[str]:
    """One unit per line. Lines end at "\\n" only, as `wc -l` and Python's text reader count
    them (str.splitlines would also split at \\x0b, \\x1c, U+2028 ... inside LM1B sentences)."""
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def paragraphs(text: str) -> list[str]:
    """Runs of non-blank lines, each joined with "\\n" (blank as in prep's readers)."""
    runs: list[list[str]] = [[]]
    for line in text.split("\n"):
        if not is_blank_line(line):
            runs[-1].append(line)
        elif runs[-1]:
            runs.append([])
    return ["\n".join(run) for run in runs if run]


# ------------------------------------------------------------------ JSON lines
def _json_value(path: Path, number: int, line: str, expected: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} line {number}: not valid JSON ({json_problem(err)}); each line must be "
                        f"one JSON object{expected}") from None


def _json_records(path: Path, text: str, expected: str = "") -> list[tuple[int, dict]]:
    """(line number, the line's object; {} for any other JSON value) of every non-blank line;
    ``expected`` ends the message of a line that is not JSON."""
    records = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not is_blank_line(line):
            value = _json_value(path, number, line, expected)
            records.append((number, value if isinstance(value, dict) else {}))
    return records


def jsonl_strings(path: Path, text: str, field: str) -> list[str]:
    """The string ``field`` of every non-blank JSON line."""
    values = []
    for number, record in _json_records(path, text):
        if field not in record:
            raise UserError(f"{path} line {number}: no field {field!r}; give the field that holds "
                            f"the text (text_field)")
        if not isinstance(record[field], str):
            raise UserError(f"{path} line {number}: field {field!r} is "
                            f"{type(record[field]).__name__}, not a string")
        values.append(record[field])
    return values


def scientific_papers_jsonl(path: Path, text: str) -> list[str]:
    """The articles of a release file of Cohan et al.'s scientific papers (``val.txt``,
    ``test.txt``: one JSON object per line, ``article_text`` a list of sentences): each
    article's sentences joined by "\\n", exactly as Hugging Face's ``scientific_papers``
    builds its ``article``."""
    expected = f" of the release ({ARTICLE_TEXT!r}: a list of sentences)"
    articles = []
    for number, record in _json_records(path, text, expected):
        sentences = record.get(ARTICLE_TEXT)
        if not isinstance(sentences, list) or not all(isinstance(sentence, str) for sentence in sentences):
            found = "missing" if sentences is None else f"a {type(sentences).__name__}"
            raise UserError(f"{path} line {number}: field {ARTICLE_TEXT!r} is {found}, not a list of strings: "
                            f"not the release's val.txt / test.txt (JSON lines with {ARTICLE_TEXT!r} a list of "
                            f"sentences)")
        articles.append("\n".join(sentences))
    return articles


# ------------------------------------------------------------------ CSV
def ag_news_csv(path: Path, text: str) -> list[str]:
    """The texts of AG News's CSV (Zhang et al.'s ``test.csv``: ``"class","title","description"``
    per line, class 1-4), read as Hugging Face's ``ag_news`` builder reads it (its csv dialect,
    universal newlines) and joined as it joins them: title, a space, description. A first
    line that is a header (as Kaggle's copy has) is skipped."""
    rows = csv.reader(io.StringIO(text, newline=None), quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL,
                      skipinitialspace=True)
    texts = []
    for row in rows:
        if len(row) != len(AG_NEWS_FIELDS):
            raise UserError(f"{path} line {rows.line_num}: {len(row)} fields, expected {len(AG_NEWS_FIELDS)} "
                            f"({', '.join(AG_NEWS_FIELDS)}): not AG News's CSV")
        label, title, description = row
        if not (label.isdigit() and int(label) in AG_NEWS_CLASSES):
            if rows.line_num == 1 and not label.strip().isdigit():
                continue  # a header line
            raise UserError(f"{path} line {rows.line_num}: class index {label!r} is not 1-4: not AG News's CSV "
                            f"({', '.join(AG_NEWS_FIELDS)})")
        texts.append(f"{title} {description}")
    return texts


# ------------------------------------------------------------------ Parquet
def parquet_strings(path: Path, column: str, expected: str = "") -> list[str]:
    """The string column ``column``; binary columns must hold UTF-8. ``expected`` says what the
    file should be, for the message when the column is missing (by default: give --text-field)."""
    fix = f"not {expected}" if expected else "give the one that holds the text (text_field)"
    try:
        schema = pq.read_schema(path)
        if column not in schema.names:
            raise UserError(f"{path}: no column {column!r}; columns are {schema.names}; {fix}")
        values = pq.read_table(path, columns=[column]).column(column)
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None
    return [_parquet_string(path, column, row, value) for row, value in enumerate(values.to_pylist())]


def _parquet_string(path: Path, column: str, row: int, value: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path} row {row} (from 0): column {column!r} is not UTF-8; re-encode "
                            f"the text as UTF-8") from None
    if not isinstance(value, str):
        raise UserError(f"{path} row {row} (from 0): column {column!r} holds {value!r}, not a "
                        f"string")
    return value

"""The zero-shot evaluation sets, read from local files and cut into detokenized text units.

    data = load_dataset("wikitext2", Path("../shared/data"))      # split="test"
    data.documents        # detokenized text units, in file order
    data.protocol()       # JSON-able record of exactly what was read and how

The files are those ``../shared/data/SOURCES.md`` describes; nothing is ever downloaded. A unit
is what SEDD's and MDLM's evaluation code reads as one (a sentence of PTB and 1BW, a LAMBADA
passage), except WikiText, cut at articles; ``rows=True`` reads the rows of the Hugging Face
datasets that code loads (the ``mdlm`` protocol), empty rows kept. Units carry no separators:
the estimator puts an EOS after each. Which file, which unit and why:
docs/evaluation.md#the-datasets-and-their-detokenizers.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError, json_problem
from common.file_records import sha256_file
from data_prep.readers.lines import is_blank_line
from evaluation.bounds.detokenizers import DETOKENIZERS

__all__ = ["DATASET_NAMES", "FILE_SPLIT", "EvalDataset", "check_text_file", "dataset_file", "load_dataset",
           "load_text_file"]

DATASET_NAMES = ("lambada", "wikitext2", "wikitext103", "ptb", "lm1b")
FILE_SPLIT = "all"  # the split recorded for a generic file: all of it
SOURCES_HINT = "../shared/data/SOURCES.md"  # relative to the repository root
# A WikiText top-level heading: " = Title = " (section headings are " = = Title = = ").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation split: its detokenized text units and how they were made."""

    name: str  # a DATASET_NAMES entry, or the file path for a generic file
    split: str  # "test" / "valid", or FILE_SPLIT for a generic file
    path: Path  # the file read
    detokenizer: str  # key of evaluation.bounds.detokenizers.DETOKENIZERS
    documents: list[str]  # detokenized text units, in file order; non-empty unless read as rows
    unit: str = "document"  # what one unit is, in words ("sentence per line", "article", ...)
    sha256: str = ""  # of the file's bytes as read; computed from `path` when left empty
    dropped_empty: int = 0  # units that were empty after detokenization and left out
    kept_empty: int = 0  # empty units kept (rows=True: each still gets its EOS)

    @property
    def utf8_bytes(self) -> int:
        """UTF-8 bytes of the detokenized text (the denominator of bits per byte)."""
        return sum(len(doc.encode("utf-8")) for doc in self.documents)

    def protocol(self) -> dict:
        """A JSON-able description of what was read and how, for reports and reproduction."""
        return {
            "name": self.name,
            "split": self.split,
            "path": str(self.path),
            "sha256": self.sha256 or sha256_file(self.path),
            "detokenizer": self.detokenizer,
            "unit": self.unit,
            "documents": len(self.documents),
            "dropped_empty": self.dropped_empty,
            "kept_empty": self.kept_empty,
            "utf8_bytes": self.utf8_bytes,
        }


# ---------------------------------------------------------------- the named datasets
@dataclass(frozen=True)
class _Units:
    """How a file is cut into raw units, and what one unit is, in words."""

    reader: Callable[[Path, str], list[str]]  # (file, its text) -> raw units
    description: str


@dataclass(frozen=True)
class _SplitSpec:
    """Where one split lives, how to cut it into units (ours, or the HF rows), how to detokenize."""

    relative_path: str
    units: _Units
    detokenizer: str
    rows: _Units  # the rows of the HF dataset that the SEDD/MDLM code reads


@dataclass(frozen=True)
class _DatasetSpec:
    sources_section: str  # where SOURCES.md says to get the files, e.g. "section 1 (PTB)"
    splits: dict[str, _SplitSpec]


def _lines(path: Path, text: str) -> list[str]:
    """One unit per line. Lines end at "\\n" only, as `wc -l` and Python's text reader count
    them (str.splitlines would also split at \\x0b, \\x1c, U+2028 ... inside LM1B sentences)."""
    del path
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def _wikitext_articles(path: Path, text: str) -> list[str]:
    """One unit per article: a top-level heading line and the lines up to the next one. Lines
    before the first heading form a unit of their own unless they are all blank."""
    lines = _lines(path, text)
    articles: list[list[str]] = [[]]
    for index, line in enumerate(lines):
        if _is_wikitext_title(lines, index):
            articles.append([])
        articles[-1].append(line)
    if not "".join(articles[0]).strip():
        articles.pop(0)
    return ["\n".join(article) for article in articles]


def _is_wikitext_title(lines: list[str], index: int) -> bool:
    """A " = Title = " line with a blank line on each side. The blank lines matter: a paragraph
    broken at an equation (" = 1 henry and capacitance C = " in the test set) looks the same,
    and counting it would give 62 test articles instead of WikiText's 60."""
    before = lines[index - 1] if index > 0 else ""
    after = lines[index + 1] if index + 1 < len(lines) else ""
    return bool(_WIKITEXT_TITLE.match(lines[index])) and not before.strip() and not after.strip()


def _wikitext_rows(path: Path, text: str) -> list[str]:
    """The rows of HF ``wikitext-*-raw-v1``: every line with its newline, a blank line as ""."""
    return [line + "\n" if line.strip() else "" for line in _lines(path, text)]


def _stripped_lines(path: Path, text: str) -> list[str]:
    """The rows of HF ``ptb_text_only`` and ``lm1b``: every line, stripped."""
    return [line.strip() for line in _lines(path, text)]


def _jsonl_texts(path: Path, text: str) -> list[str]:
    return _jsonl_field(path, text, "text")


_SENTENCES = _Units(_lines, "sentence per line")
_SENTENCE_ROWS = _Units(_stripped_lines, "sentence per line, stripped (a row of HF ptb_text_only / lm1b)")
_LM1B_SHARD = " (heldout shard 00000, the benchmark's test set)"
_WIKITEXT_SPLITS = {
    split: _SplitSpec(
        f"wikitext-2-raw/wiki.{split}.raw",
        _Units(_wikitext_articles, "article (a top-level ' = Title = ' heading and the lines up to the next one)"),
        "wikitext",
        _Units(_wikitext_rows, "line with its newline (a row of HF wikitext-*-raw-v1; a blank line is an "
                               "empty row)"))
    for split in ("test", "valid")
}
_LAMBADA_TEST = _Units(_jsonl_texts, "passage per JSON line ('text' field of OpenAI's GPT-2 test file)")
_LAMBADA_DEV = _Units(_lines, "passage per line (original LAMBADA development set: lower-cased and "
                              "tokenized, not comparable with the test file)")
_SPECS: dict[str, _DatasetSpec] = {
    "ptb": _DatasetSpec("section 1 (Penn Treebank)", {
        split: _SplitSpec(f"ptb/ptb.{split}.txt", _SENTENCES, "ptb", _SENTENCE_ROWS)
        for split in ("test", "valid")
    }),
    "wikitext2": _DatasetSpec("section 2b (WikiText-2 raw)", _WIKITEXT_SPLITS),
    "wikitext103": _DatasetSpec("sections 2b and 3 (WikiText-103 shares WikiText-2's raw test "
                                "and valid files)", _WIKITEXT_SPLITS),
    "lambada": _DatasetSpec("section 4 (LAMBADA)", {
        "test": _SplitSpec("lambada/lambada_test.jsonl", _LAMBADA_TEST, "lambada", _LAMBADA_TEST),
        "valid": _SplitSpec("lambada/lambada_development_plain_text.txt", _LAMBADA_DEV, "lambada_plain",
                            _LAMBADA_DEV),
    }),
    "lm1b": _DatasetSpec("section 5 (One Billion Word)", {
        "test": _SplitSpec("lm1b/news.en.heldout-00000-of-00050",
                           _Units(_lines, _SENTENCES.description + _LM1B_SHARD), "lm1b",
                           _Units(_stripped_lines, _SENTENCE_ROWS.description + _LM1B_SHARD)),
    }),
}


def load_dataset(name: str, data_dir: Path, split: str = "test", *, detokenizer: str | None = None,
                 rows: bool = False) -> EvalDataset:
    """Read one split of a zero-shot set from ``data_dir`` (laid out as ../shared/data) and cut
    it into detokenized units. ``detokenizer`` overrides the set's standard one (for example
    "lambada_gpt2" to keep the GPT-2 / SEDD leading newline). ``rows``: the units are the rows
    of the HF dataset the SEDD/MDLM code reads, empty ones kept (docs/evaluation.md#mdlms-protocol)."""
    split_spec = _split_spec(name, _dataset_spec(name), split)
    path = dataset_file(name, data_dir, split)
    data, text = _read_utf8(path)
    units = split_spec.rows if rows else split_spec.units
    return _build(name, split, path, data, units.reader(path, text), detokenizer or split_spec.detokenizer,
                  units.description, keep_empty=rows)


def dataset_file(name: str, data_dir: Path, split: str = "test") -> Path:
    """The file that ``load_dataset`` reads, checked to exist (cheap: for validating a list of
    datasets before evaluating any)."""
    spec = _dataset_spec(name)
    path = Path(data_dir) / _split_spec(name, spec, split).relative_path
    if not path.is_file():
        raise UserError(f"{name} {split}: expected file {path} does not exist; see "
                        f"{SOURCES_HINT} {spec.sources_section} for where to get it, and check "
                        f"that the data directory {data_dir} is the shared data folder")
    return path


def _dataset_spec(name: str) -> _DatasetSpec:
    if name not in _SPECS:
        raise UserError(f"unknown evaluation dataset {name!r}; choose one of "
                        f"{', '.join(DATASET_NAMES)} (a file of your own, .txt, .jsonl or "
                        f".parquet, is read with load_text_file)")
    return _SPECS[name]


def _split_spec(name: str, spec: _DatasetSpec, split: str) -> _SplitSpec:
    if split not in spec.splits:
        raise UserError(f"{name} has no split {split!r}; valid splits: "
                        f"{', '.join(spec.splits)}")
    return spec.splits[split]


# ---------------------------------------------------------------- generic files
_GENERIC_UNITS = {
    ".txt": "paragraph (blank-line separated)",
    ".jsonl": "record per JSON line (field {field!r})",
    ".parquet": "row (column {field!r})",
}


def load_text_file(path: Path, *, text_field: str = "text",
                   detokenizer: str = "identity") -> EvalDataset:
    """Read any local text set: .txt (one document per blank-line separated paragraph), .jsonl
    (the string field ``text_field`` of each line) or .parquet (the string column
    ``text_field``), detokenized with ``detokenizer`` (a DETOKENIZERS key)."""
    path = check_text_file(path, detokenizer)
    suffix = path.suffix.lower()
    data, raw_units = _read_generic(path, suffix, text_field)
    unit = _GENERIC_UNITS[suffix].format(field=text_field)
    return _build(str(path), FILE_SPLIT, path, data, raw_units, detokenizer, unit)


def check_text_file(path: Path, detokenizer: str = "identity") -> Path:
    """A file ``load_text_file`` can read, with ``detokenizer``: a supported type that exists
    (checked before reading it, or any other dataset)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _GENERIC_UNITS:
        raise UserError(f"{path}: unsupported evaluation file type {suffix or '(none)'!r}; "
                        f"use one of {', '.join(_GENERIC_UNITS)}")
    _detokenizer(detokenizer)  # fail on a bad key before reading a large file
    if not path.is_file():
        raise UserError(f"{path}: evaluation file does not exist; check the path")
    return path


def _read_generic(path: Path, suffix: str, field: str) -> tuple[bytes, list[str]]:
    """The file's bytes and its raw units."""
    if suffix == ".parquet":
        data = path.read_bytes()
        return data, _parquet_column(path, field)
    data, text = _read_utf8(path)
    text = text.replace("\r\n", "\n")  # Windows files read like Unix ones
    if suffix == ".jsonl":
        return data, _jsonl_field(path, text, field)
    return data, _paragraphs(text)


def _paragraphs(text: str) -> list[str]:
    """Runs of non-blank lines, each joined with "\\n" (blank as in prep's readers)."""
    paragraphs: list[list[str]] = [[]]
    for line in text.split("\n"):
        if not is_blank_line(line):
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    return ["\n".join(lines) for lines in paragraphs if lines]


def _jsonl_field(path: Path, text: str, field: str) -> list[str]:
    """The string ``field`` of every non-blank JSON line."""
    values = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not is_blank_line(line):
            values.append(_json_string(path, number, line, field))
    return values


def _json_string(path: Path, number: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} line {number}: not valid JSON ({json_problem(err)}); each line must be "
                        f"one JSON object") from None
    if not isinstance(record, dict) or field not in record:
        raise UserError(f"{path} line {number}: no field {field!r}; give the field that holds "
                        f"the text (text_field)")
    if not isinstance(record[field], str):
        raise UserError(f"{path} line {number}: field {field!r} is "
                        f"{type(record[field]).__name__}, not a string")
    return record[field]


def _parquet_column(path: Path, field: str) -> list[str]:
    """The string column ``field``; binary columns must hold UTF-8."""
    try:
        schema = pq.read_schema(path)
        if field not in schema.names:
            raise UserError(f"{path}: no column {field!r}; columns are {schema.names}; give the "
                            f"one that holds the text (text_field)")
        column = pq.read_table(path, columns=[field]).column(field)
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None
    return [_parquet_value(path, field, row, value) for row, value in enumerate(column.to_pylist())]


def _parquet_value(path: Path, field: str, row: int, value: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path} row {row} (from 0): column {field!r} is not UTF-8; re-encode "
                            f"the text as UTF-8") from None
    if not isinstance(value, str):
        raise UserError(f"{path} row {row} (from 0): column {field!r} holds {value!r}, not a "
                        f"string")
    return value


# ---------------------------------------------------------------- shared steps
def _read_utf8(path: Path) -> tuple[bytes, str]:
    """The file's bytes and their text; a UTF-8 byte-order mark is dropped."""
    data = path.read_bytes()
    try:
        return data, data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"{path} line {line}: byte {err.start} is not UTF-8 ({err.reason}); "
                        f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _detokenizer(key: str) -> Callable[[str], str]:
    if key not in DETOKENIZERS:
        raise UserError(f"unknown detokenizer {key!r}; choose one of {', '.join(DETOKENIZERS)}")
    return DETOKENIZERS[key]


def _build(name: str, split: str, path: Path, data: bytes, raw_units: Iterable[str],
           detokenizer: str, unit: str, *, keep_empty: bool = False) -> EvalDataset:
    """Detokenize the units, drop (and count) the empty ones unless ``keep_empty`` (then count
    them), refuse a dataset with no text."""
    detokenize = _detokenizer(detokenizer)
    # Raw units go in unstripped: where a line's edge spaces go is the detokenizer's call
    # (WikiText's " . " rule needs the space every line ends with).
    converted = [detokenize(raw) for raw in raw_units]
    documents = [doc for doc in converted if doc.strip()]
    if not documents:
        raise UserError(f"{path}: no text left after detokenizing with {detokenizer!r}; "
                        f"check that this is the right file and field")
    empty = len(converted) - len(documents)
    return EvalDataset(name=name, split=split, path=path, detokenizer=detokenizer,
                       documents=converted if keep_empty else documents, unit=unit,
                       sha256=hashlib.sha256(data).hexdigest(), dropped_empty=0 if keep_empty else empty,
                       kept_empty=empty if keep_empty else 0)



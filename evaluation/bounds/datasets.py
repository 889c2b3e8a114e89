"""The zero-shot evaluation sets, read from local files and cut into detokenized text units.

    data = load_dataset("wikitext2", Path("../shared/data"))      # split="test"
    data.documents        # detokenized text units, in file order
    data.protocol()       # JSON-able record of exactly what was read and how

The files are those ``../shared/data/SOURCES.md`` describes, in its layout, plus AG News, PubMed
and ArXiv in the formats their releases and Hugging Face give (``evaluation.bounds.file_readers``);
nothing is ever downloaded. A unit is what SEDD's and MDLM's evaluation code reads as one (a
sentence of PTB and 1BW, a LAMBADA passage, an AG News item, an article), except WikiText, cut at
articles; ``rows=True`` reads the rows of the Hugging Face datasets that code loads (the
MDLM-line protocols), empty rows kept. Units carry no separators: the protocol puts an EOS after
each, or none. Which file, which unit and why: docs/evaluation.md#the-datasets-and-their-detokenizers.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.file_records import sha256_file
from evaluation.bounds.detokenizers import DETOKENIZERS
from evaluation.bounds.file_readers import (
    ag_news_csv,
    decode_utf8,
    jsonl_strings,
    lines,
    paragraphs,
    parquet_strings,
    scientific_papers_jsonl,
)

__all__ = ["DATASET_NAMES", "FILE_SPLIT", "EvalDataset", "check_text_file", "dataset_file", "expected_files",
           "find_dataset_file", "load_dataset", "load_text_file"]

DATASET_NAMES = ("lambada", "wikitext2", "wikitext103", "ptb", "lm1b", "ag_news", "pubmed", "arxiv")
FILE_SPLIT = "all"  # the split recorded for a generic file: all of it
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
Reader = Callable[[Path, bytes], list[str]]  # (file, its bytes) -> raw units


@dataclass(frozen=True)
class _Units:
    """How a file is cut into raw units, and what one unit is, in words."""

    reader: Reader
    description: str


@dataclass(frozen=True)
class _SplitFile:
    """One file a split may be read from: where, in which format, cut into which units (ours, or
    the rows of the Hugging Face dataset the MDLM-line code reads)."""

    relative_path: str
    format: str   # what the file holds, in words, for the messages
    units: _Units
    rows: _Units


@dataclass(frozen=True)
class _SplitSpec:
    """Where one split lives (the first of ``files`` that exists is read) and its detokenizer."""

    files: tuple[_SplitFile, ...]
    detokenizer: str


@dataclass(frozen=True)
class _DatasetSpec:
    sources: str  # where to get the files, in words, e.g. "see ../shared/data/SOURCES.md section 1 (PTB)"
    splits: dict[str, _SplitSpec]


def _text(reader: Callable[[Path, str], list[str]]) -> Reader:
    """A reader of the file's UTF-8 text."""
    return lambda path, data: reader(path, decode_utf8(path, data))


def _parquet(column: str, split: str) -> Reader:
    return lambda path, data: parquet_strings(path, column, f"a parquet of {split} (its column {column!r})")


def _wikitext_articles(path: Path, text: str) -> list[str]:
    """One unit per article: a top-level heading line and the lines up to the next one. Lines
    before the first heading form a unit of their own unless they are all blank."""
    rows = lines(text)
    articles: list[list[str]] = [[]]
    for index, line in enumerate(rows):
        if _is_wikitext_title(rows, index):
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
    return [line + "\n" if line.strip() else "" for line in lines(text)]


def _stripped_lines(path: Path, text: str) -> list[str]:
    """The rows of HF ``ptb_text_only`` and ``lm1b``: every line, stripped."""
    return [line.strip() for line in lines(text)]


def _jsonl_texts(path: Path, text: str) -> list[str]:
    return jsonl_strings(path, text, "text")


def _one_file(relative_path: str, units: _Units, detokenizer: str, rows: _Units | None = None) -> _SplitSpec:
    """A split of one plain file (the sets of ../shared/data)."""
    return _SplitSpec((_SplitFile(relative_path, "", units, rows or units),), detokenizer)


_SENTENCES = _Units(_text(lambda path, text: lines(text)), "sentence per line")
_SENTENCE_ROWS = _Units(_text(_stripped_lines), "sentence per line, stripped (a row of HF ptb_text_only / lm1b)")
_LM1B_SHARD = " (heldout shard 00000, the benchmark's test set)"
_WIKITEXT_SPLITS = {
    split: _one_file(
        f"wikitext-2-raw/wiki.{split}.raw",
        _Units(_text(_wikitext_articles),
               "article (a top-level ' = Title = ' heading and the lines up to the next one)"),
        "wikitext",
        _Units(_text(_wikitext_rows), "line with its newline (a row of HF wikitext-*-raw-v1; a blank line is an "
                                      "empty row)"))
    for split in ("test", "valid")
}
_LAMBADA_TEST = _Units(_text(_jsonl_texts), "passage per JSON line ('text' field of OpenAI's GPT-2 test file)")
_LAMBADA_DEV = _Units(_text(lambda path, text: lines(text)),
                      "passage per line (original LAMBADA development set: lower-cased and "
                      "tokenized, not comparable with the test file)")

# AG News (Zhang et al. 2015): its test split only, the CSV Hugging Face's builder downloads, or a
# parquet of that builder's split. One unit is one news item, as HF's ``text`` joins it.
_AG_NEWS_ITEM = "news item: title, a space, description (the text of HF ag_news)"
_AG_NEWS = _DatasetSpec(
    "see ../shared/data/SOURCES.md section 8 (AG News) for where to get the CSV, or save Hugging Face's "
    "ag_news test split as ag_news/test.parquet",
    {"test": _SplitSpec((
        _SplitFile("ag_news/test.csv", "AG News's CSV: class index, title, description",
                   *(2 * (_Units(_text(ag_news_csv), _AG_NEWS_ITEM),))),
        _SplitFile("ag_news/test.parquet", "a parquet of Hugging Face's ag_news test split, column 'text'",
                   *(2 * (_Units(_parquet("text", "Hugging Face's ag_news test split"), _AG_NEWS_ITEM),)))),
        "ag_news")})

# Cohan et al.'s scientific papers (PubMed, ArXiv): the release's JSON lines as they come out of
# its zip (DIR/pubmed/val.txt, or the zip unzipped into DIR/pubmed), or a parquet of Hugging Face's
# scientific_papers split. One unit is one article, its sentences joined by "\n" as HF's ``article``.
_ARTICLE = "article: the release's article_text sentences joined by a newline (the article of HF scientific_papers)"
_RELEASE_SPLIT = {"valid": ("val", "validation"), "test": ("test", "test")}
_RELEASE_URL = "https://s3.amazonaws.com/datasets.huggingface.co/scientific_papers/1.1.1/{name}-dataset.zip"


def _scientific_papers(name: str, megabytes: int) -> _DatasetSpec:
    release = _Units(_text(scientific_papers_jsonl), _ARTICLE)
    splits = {}
    for split, (release_name, hf_split) in _RELEASE_SPLIT.items():
        hf_name = f"Hugging Face's scientific_papers/{name} {hf_split} split"
        parquet = _Units(_parquet("article", hf_name), _ARTICLE)
        json_lines = f"the release's {release_name}.txt: JSON lines, 'article_text' a list of sentences"
        splits[split] = _SplitSpec((
            _SplitFile(f"{name}/{release_name}.txt", json_lines, release, release),
            _SplitFile(f"{name}/{name}-dataset/{release_name}.txt", json_lines, release, release),
            _SplitFile(f"{name}/{hf_split}.parquet", f"a parquet of {hf_name}, column 'article'", parquet, parquet)),
            "scientific_papers")
    return _DatasetSpec(f"not in ../shared/data ({megabytes} MB, SOURCES.md section 9): unzip "
                        f"{_RELEASE_URL.format(name=name)} into the data directory's {name}/, or save Hugging Face's "
                        f"scientific_papers/{name} split as {name}/validation.parquet or {name}/test.parquet", splits)


_SPECS: dict[str, _DatasetSpec] = {
    "ptb": _DatasetSpec("see ../shared/data/SOURCES.md section 1 (Penn Treebank) for where to get it", {
        split: _one_file(f"ptb/ptb.{split}.txt", _SENTENCES, "ptb", _SENTENCE_ROWS)
        for split in ("test", "valid")
    }),
    "wikitext2": _DatasetSpec("see ../shared/data/SOURCES.md section 2b (WikiText-2 raw) for where to get it",
                              _WIKITEXT_SPLITS),
    "wikitext103": _DatasetSpec("see ../shared/data/SOURCES.md sections 2b and 3 (WikiText-103 shares WikiText-2's "
                                "raw test and valid files) for where to get it", _WIKITEXT_SPLITS),
    "lambada": _DatasetSpec("see ../shared/data/SOURCES.md section 4 (LAMBADA) for where to get it", {
        "test": _one_file("lambada/lambada_test.jsonl", _LAMBADA_TEST, "lambada"),
        "valid": _one_file("lambada/lambada_development_plain_text.txt", _LAMBADA_DEV, "lambada_plain"),
    }),
    "lm1b": _DatasetSpec("see ../shared/data/SOURCES.md section 5 (One Billion Word) for where to get it", {
        "test": _one_file("lm1b/news.en.heldout-00000-of-00050",
                          _Units(_SENTENCES.reader, _SENTENCES.description + _LM1B_SHARD), "lm1b",
                          _Units(_SENTENCE_ROWS.reader, _SENTENCE_ROWS.description + _LM1B_SHARD)),
    }),
    "ag_news": _AG_NEWS,
    "pubmed": _scientific_papers("pubmed", 127),
    "arxiv": _scientific_papers("arxiv", 217),
}


def load_dataset(name: str, data_dir: Path, split: str = "test", *, detokenizer: str | None = None,
                 rows: bool = False) -> EvalDataset:
    """Read one split of a zero-shot set from ``data_dir`` (laid out as ../shared/data) and cut
    it into detokenized units. ``detokenizer`` overrides the set's standard one (for example
    "lambada_gpt2" to keep the GPT-2 / SEDD leading newline). ``rows``: the units are the rows
    of the HF dataset the MDLM-line code reads, empty ones kept (docs/evaluation.md#mdlms-protocol)."""
    split_spec = _split_spec(name, _dataset_spec(name), split)
    path = dataset_file(name, data_dir, split)
    split_file = next(file for file in split_spec.files if path == Path(data_dir) / file.relative_path)
    units = split_file.rows if rows else split_file.units
    data = path.read_bytes()
    return _build(name, split, path, data, units.reader(path, data), detokenizer or split_spec.detokenizer,
                  units.description, keep_empty=rows)


def dataset_file(name: str, data_dir: Path, split: str = "test") -> Path:
    """The file that ``load_dataset`` reads (the first of the split's files that exists),
    checked to exist (cheap: for validating a list of datasets before evaluating any)."""
    found = find_dataset_file(name, data_dir, split)
    if found is None:
        spec = _dataset_spec(name)
        files = spec.splits[split].files
        raise UserError(f"{name} {split}: {_expected([Path(data_dir) / file.relative_path for file in files], files)}; "
                        f"{spec.sources}, and check that --data-dir {data_dir} is the data folder")
    return found


def find_dataset_file(name: str, data_dir: Path, split: str = "test") -> Path | None:
    """The file that ``load_dataset`` would read, or None when none of the split's files is
    there (an unknown dataset or split is refused)."""
    files = _split_spec(name, _dataset_spec(name), split).files
    return next((path for file in files if (path := Path(data_dir) / file.relative_path).is_file()), None)


def expected_files(name: str, split: str) -> str:
    """The files ``name``'s ``split`` is read from under a data directory, and where to get them,
    in words (for a missing set of a suite)."""
    spec = _dataset_spec(name)
    files = _split_spec(name, spec, split).files
    return f"{_expected([Path(file.relative_path) for file in files], files)}; {spec.sources}"


def _expected(paths: list[Path], files: tuple[_SplitFile, ...]) -> str:
    if len(paths) == 1:
        return f"expected file {paths[0]} does not exist"
    by_format: dict[str, list[Path]] = {}
    for path, file in zip(paths, files):
        by_format.setdefault(file.format, []).append(path)
    return "expected " + " or ".join(f"{' or '.join(map(str, group))} ({format})"
                                     for format, group in by_format.items())


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
    data = path.read_bytes()
    if suffix == ".parquet":
        return data, parquet_strings(path, field)
    text = decode_utf8(path, data).replace("\r\n", "\n")  # Windows files read like Unix ones
    if suffix == ".jsonl":
        return data, jsonl_strings(path, text, field)
    return data, paragraphs(text)


# ---------------------------------------------------------------- shared steps
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



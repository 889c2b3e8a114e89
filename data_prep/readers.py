"""Corpus readers: raw text, JSONL and Parquet corpora in, a stream of document text out.

The data-preparation stage uses them in three steps:

    files = resolve_inputs(["corpus/**/*.jsonl.gz"])   # which files, in a fixed order
    units = plan_units(files, options)                  # independent work units, in corpus order
    for piece in read_unit(unit, options, counters):    # on a Ray worker, one unit at a time
        ...                                             # tokenize; EOS goes after piece.last

A unit is a byte range of an uncompressed text or JSONL file, a whole gzip file, or a run of
Parquet row groups. Byte ranges follow the Hadoop split rule: a unit owns every document that
begins inside its range and reads past its end to finish the last one, so the outputs of a
file's units, concatenated in plan order, are exactly the output of reading the file whole.

Everything streams: files are read in blocks of READ_BLOCK_BYTES, and a document longer than
``max_piece_bytes`` comes out as several pieces, so memory does not grow with file or document
size (except that a JSONL line is parsed whole). Lines end at "\\n"; a "\\r" just before it is
part of the line end, so CRLF files read like LF files.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from fnmatch import fnmatchcase
from itertools import chain, groupby
from operator import itemgetter
from typing import Iterable, Iterator, Literal, Sequence, get_args

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.errors import UserError

__all__ = [
    "DEFAULT_PIECE_BYTES", "DEFAULT_UNIT_BYTES", "MAX_JSONL_LINE_BYTES", "MIN_PIECE_BYTES",
    "READ_BLOCK_BYTES", "BINARY_CHECK_BYTES", "InputFile", "Piece", "ReadCounters", "ReadOptions",
    "TextFormat", "WorkUnit", "binary_reason", "plan_units", "read_unit", "resolve_inputs",
]

# Plain text: documents separated by blank lines / one document per line / one per file.
TextFormat = Literal["paragraphs", "lines", "file"]
BadUtf8 = Literal["replace", "skip"]
BadJson = Literal["error", "skip"]
FileFormat = Literal["text", "jsonl", "parquet"]

# 64 MiB per unit: big enough that a task's fixed costs (scheduling it, opening the file,
# counting the lines before its range) stay small next to tokenizing it, small enough that an
# OpenWebText-sized corpus (~40 GB) still makes ~600 units to balance over the workers.
DEFAULT_UNIT_BYTES = 64 << 20
# 1 MiB per piece: longer than nearly every web document, so most documents are one piece,
# while a book-sized one still reaches the tokenizer in bounded chunks.
DEFAULT_PIECE_BYTES = 1 << 20
# One read per MiB amortizes the cost of a call (a syscall, or an HTTP range request on an
# object store) and bounds the memory a reader holds.
READ_BLOCK_BYTES = 1 << 20
# The longest UTF-8 character, so that every piece holds at least one.
MIN_PIECE_BYTES = 4
# A JSONL line is parsed whole. A line this long is not a document but a file that is not JSONL
# (one big JSON array, say); stopping here fails it before it exhausts a worker's memory.
MAX_JSONL_LINE_BYTES = 256 << 20

_BOM = codecs.BOM_UTF8
# A text or JSONL file is binary, and skipped whole, when its first BINARY_CHECK_BYTES
# (decompressed) hold a NUL byte, as git and GNU grep decide; or when it starts with a UTF-16
# or UTF-32 byte-order mark (such text holds NULs where it is ASCII; CJK text may hold none).
BINARY_CHECK_BYTES = 8000
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
_EXTENSIONS: dict[str, FileFormat] = {
    "txt": "text", "text": "text", "raw": "text", "tokens": "text",
    "jsonl": "jsonl", "json": "jsonl",
    "parquet": "parquet",
}
# A last suffix that looks like a file type (1-5 letters and digits, at least one letter: csv,
# md, bz2, zst) but is not one of _EXTENSIONS is an error. Any other suffix is part of the name
# ("news.en.heldout-00000-of-00050", "part.00001") and the file is plain text.
_FILE_TYPE_LIKE = re.compile(r"(?=[a-z0-9]*[a-z])[a-z0-9]{1,5}")
_GLOB_CHARS = re.compile(r"[*?\[]")
# Arrow types a text column may have, each with the binary type that views the same bytes.
_TEXT_COLUMN_TYPES = {
    pa.string(): pa.binary(), pa.large_string(): pa.large_binary(),
    pa.binary(): pa.binary(), pa.large_binary(): pa.large_binary(),
}
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}
_SURROGATES = re.compile("[\ud800-\udfff]")
_JSON = json.JSONDecoder()  # as json.loads makes it
# Bytes checked at a time: bounds the text that checking makes (up to 4 bytes a character).
_CHECK_STEP_BYTES = 64 << 10


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class ReadOptions:
    """How to read the corpus; each field is the CLI flag named beside it."""

    text_format: TextFormat = "paragraphs"  # --text-format (plain-text files only)
    text_field: str = "text"                # --text-field: the JSONL field holding the text
    text_column: str = "text"               # --text-column: the Parquet column holding it
    bad_utf8: BadUtf8 = "replace"           # --bad-utf8: repair with U+FFFD, or skip the document
    bad_json: BadJson = "error"             # --bad-json: on a broken JSONL line, stop or skip it
    max_piece_bytes: int = DEFAULT_PIECE_BYTES  # longer documents come out in pieces

    def __post_init__(self) -> None:
        for flag, value, choices in (("--text-format", self.text_format, TextFormat),
                                     ("--bad-utf8", self.bad_utf8, BadUtf8),
                                     ("--bad-json", self.bad_json, BadJson)):
            if value not in get_args(choices):
                raise UserError(f"{flag} must be one of {', '.join(get_args(choices))}, got {value!r}")
        if self.max_piece_bytes < MIN_PIECE_BYTES:
            raise UserError(f"max_piece_bytes must be at least {MIN_PIECE_BYTES} (the longest "
                            f"UTF-8 character), got {self.max_piece_bytes}")


@dataclass(frozen=True)
class InputFile:
    """One input file: where it is, how to read it."""

    uri: str                           # absolute local path, or a pyarrow-filesystem URI
    format: FileFormat
    compression: Literal["gzip"] | None
    size: int                          # bytes on storage


@dataclass(frozen=True)
class WorkUnit:
    """A part of one file that a worker reads on its own."""

    index: int        # position in the plan; the plan order is the corpus order
    file: InputFile
    start: int        # uncompressed text/JSONL: byte offset; Parquet: first row group; gzip: 0
    end: int          # exclusive byte offset or row group; gzip: the file size (the whole file)


@dataclass(frozen=True)
class Piece:
    """A document, or a part of one: concatenating a document's pieces gives its text."""

    text: str
    source: str       # where the document starts: "path:LINE" (1-based), or "path#row=N" (0-based)
    first: bool       # first piece of its document
    last: bool        # last piece of its document (EOS goes after it)


@dataclass
class ReadCounters:
    """What reading kept and dropped; a worker fills one per unit and the driver sums them."""

    documents: int = 0          # documents yielded
    utf8_bytes: int = 0         # UTF-8 bytes of their text, after repair (for bits per byte)
    empty_skipped: int = 0      # empty or whitespace-only documents
    bad_utf8_repaired: int = 0  # documents yielded with invalid UTF-8 replaced by U+FFFD
    bad_utf8_skipped: int = 0   # documents dropped for invalid UTF-8 (--bad-utf8 skip)
    bad_json_skipped: int = 0   # JSONL lines dropped as broken (--bad-json skip)
    binary_files_skipped: int = 0  # text/JSONL files left out whole as binary (binary_reason)

    def __add__(self, other: ReadCounters) -> ReadCounters:
        return ReadCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)})

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# ---------------------------------------------------------------- finding the files
def resolve_inputs(patterns: Sequence[str]) -> list[InputFile]:
    """The input files that `patterns` name, sorted by URI, without duplicates.

    A pattern is a file, a directory (every file below it), or a glob: ``*``, ``?`` and
    ``[...]`` match within one path component, and a ``**`` component matches any number of
    them. Patterns are local paths or URIs that ``pyarrow.fs.FileSystem.from_uri`` opens
    (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ...); a glob cannot hold a URI query.
    Hidden files and directories (names starting with ".") below a directory or a glob are
    left out. Local files are named by their absolute path, however the pattern named them.

    The format comes from the name: .txt .text .raw .tokens or no extension: plain text;
    .jsonl .json: JSON lines; .parquet: Parquet; text and JSONL may add .gz. A name whose last
    suffix looks like another file type (1-5 letters and digits, one a letter) is an error; any
    other suffix is part of the name and the file is plain text.
    """
    if not patterns:
        raise UserError("no inputs given: name files, directories or globs")
    found = {file.uri: file for pattern in patterns for file in _expand(pattern)}
    return [found[uri] for uri in sorted(found)]


def _expand(pattern: str) -> list[InputFile]:
    """The files one pattern names; a UserError if it names none."""
    glob = _GLOB_CHARS.search(pattern)
    root = pattern if glob is None else pattern[:pattern.rfind("/", 0, glob.start()) + 1]
    fs, path = _filesystem(root or ".")
    if glob is not None:
        matches = _matching_files(fs, path, pattern[len(root):])
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            matches = [info]
        elif info.type == pafs.FileType.Directory:
            matches = _matching_files(fs, path, "**")
        else:
            raise UserError(f"{pattern}: no such file or directory")
    if not matches:
        raise UserError(f"{pattern}: matches no files (hidden files are left out)")
    prefix = _uri_prefix(fs, root or ".", path)
    return [_input_file(prefix + match.path, match.size) for match in matches]


def _matching_files(fs: pafs.FileSystem, root: str, glob: str) -> list[pafs.FileInfo]:
    """The files below directory `root` whose relative path matches `glob`, hidden ones left out."""
    globs = glob.split("/")
    recursive = len(globs) > 1 or "**" in globs
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=recursive))
    base = len(root.rstrip("/")) + 1
    matches = []
    for info in infos:
        parts = info.path[base:].split("/")
        if (info.type == pafs.FileType.File and not any(part.startswith(".") for part in parts)
                and _glob_match(parts, globs)):
            matches.append(info)
    return matches


def _glob_match(parts: list[str], globs: list[str]) -> bool:
    """Whether path components `parts` match glob components `globs` ("**" matches any number)."""
    if not globs:
        return not parts
    if globs[0] == "**":
        return any(_glob_match(parts[skip:], globs[1:]) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], globs[0]) and _glob_match(parts[1:], globs[1:])


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds `uri` and the path inside it; a plain path is local."""
    try:
        return pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{uri}: not a local path or a URI that pyarrow can open ({err})") from err


def _uri_prefix(fs: pafs.FileSystem, uri: str, path: str) -> str:
    """What turns a path in `fs` back into a URI ("s3://" for "s3://bucket/key", whose path is
    "bucket/key"); nothing for local files, which are named by their absolute path."""
    if isinstance(fs, pafs.LocalFileSystem):
        return ""
    uri, path = uri.rstrip("/"), path.rstrip("/")
    if not uri.endswith(path):
        raise UserError(f"{uri}: cannot name the files below this URI; write it without "
                        f"%-escapes or a query string")
    return uri[:len(uri) - len(path)]


def _input_file(uri: str, size: int) -> InputFile:
    """An InputFile, its format and compression read from its name (see resolve_inputs)."""
    name = uri.rsplit("/", 1)[-1].lower()
    stem, compression = (name[:-3], "gzip") if name.endswith(".gz") else (name, None)
    _, dot, extension = stem.rpartition(".")
    if dot and extension in _EXTENSIONS:
        file_format = _EXTENSIONS[extension]
    elif dot and _FILE_TYPE_LIKE.fullmatch(extension):
        raise UserError(
            f"{uri}: unknown file type '.{extension}'. Readable: .txt .text .raw .tokens or no "
            f"extension (plain text), .jsonl .json (one JSON object per line), .parquet; text "
            f"and JSONL may end in .gz. Rename the file or leave it out of the inputs")
    else:
        file_format = "text"
    if file_format == "parquet" and compression:
        raise UserError(f"{uri}: gzip around a Parquet file is not supported (Parquet compresses "
                        f"its own pages); decompress the file")
    return InputFile(uri, file_format, compression, size)


# ---------------------------------------------------------------- planning
def plan_units(files: Sequence[InputFile], options: ReadOptions,
               target_unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[WorkUnit]:
    """Split the files into work units of about `target_unit_bytes`, numbered in corpus order.

    Uncompressed text and JSONL files are cut into byte ranges; a gzip file, which cannot be
    read from the middle, and a text file read as one document are one unit each; a Parquet
    file is cut between row groups (at least one per unit), sized by its text column.
    """
    if target_unit_bytes < 1:
        raise ValueError(f"target_unit_bytes must be >= 1, got {target_unit_bytes}")
    ranges = [(file, start, end) for file in files
              for start, end in _file_ranges(file, options, target_unit_bytes)]
    return [WorkUnit(index, file, start, end) for index, (file, start, end) in enumerate(ranges)]


def _file_ranges(file: InputFile, options: ReadOptions, target: int) -> list[tuple[int, int]]:
    """The (start, end) of each unit of one file."""
    if file.format == "parquet":
        return _row_group_ranges(file, options.text_column, target)
    if file.compression or (file.format == "text" and options.text_format == "file"):
        return [(0, file.size)]
    return [(start, min(start + target, file.size)) for start in range(0, file.size, target)]


def _row_group_ranges(file: InputFile, column: str, target: int) -> list[tuple[int, int]]:
    """Runs of consecutive row groups whose text column holds about `target` bytes."""
    fs, path = _filesystem(file.uri)
    with fs.open_input_file(path) as handle:
        parquet = _parquet_file(handle, file)
        _check_text_column(parquet, file, column)
        metadata = parquet.metadata
        leaves = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
        leaf = leaves.index(column)
        sizes = [metadata.row_group(group).column(leaf).total_uncompressed_size
                 for group in range(metadata.num_row_groups)]
    ranges, first, total = [], 0, 0
    for group, size in enumerate(sizes):
        total += size
        if total >= target:
            ranges.append((first, group + 1))
            first, total = group + 1, 0
    if first < len(sizes):
        ranges.append((first, len(sizes)))
    return ranges


# ---------------------------------------------------------------- reading
def read_unit(unit: WorkUnit, options: ReadOptions, counters: ReadCounters) -> Iterator[Piece]:
    """The pieces of the documents that `unit` owns, in file order; fills `counters`.

    Plain text documents are paragraphs (runs of non-blank lines, a blank line being empty or
    only ASCII whitespace, joined with "\\n"), lines, or the whole file as is. A JSONL line is one
    object whose `options.text_field` is the document; blank lines are allowed. A Parquet row's
    `options.text_column` is the document; null counts as empty. A UTF-8 byte-order mark at the
    start of a file is dropped. Empty and whitespace-only documents are skipped.

    Invalid UTF-8 (in JSONL: in the text field) is repaired with U+FFFD or skips the document,
    per `options.bad_utf8`; a skipped document yields no piece, however long it is. For that, a
    plain-text document longer than `options.max_piece_bytes` is read twice: checked, then cut
    into pieces (in a gzip file the second read decompresses again from the file's start).

    A binary text or JSONL file (see `binary_reason`) yields nothing; its first unit counts
    it in `counters.binary_files_skipped`.
    """
    if unit.file.format == "parquet":
        yield from _read_parquet(unit, options, counters)
        return
    with _Source(unit.file) as source:
        if _binary_reason(source.head(BINARY_CHECK_BYTES)) is not None:
            counters.binary_files_skipped += unit.start == 0  # once per file, by its first unit
            return
        if unit.file.format == "jsonl":
            yield from _read_jsonl(source, unit, options, counters)
        else:
            yield from _read_text(source, unit, options, counters)


class _Source:
    """The bytes of one text or JSONL file, decompressed if gzip, read in blocks. Offsets are
    in the (decompressed) text; only uncompressed files can be read at an offset cheaply."""

    def __init__(self, file: InputFile) -> None:
        self.file = file
        self._fs, self._path = _filesystem(file.uri)
        self._handle = None if file.compression else self._fs.open_input_file(self._path)

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._handle is not None:
            self._handle.close()

    def blocks(self, start: int) -> Iterator[bytes]:
        """The bytes from offset `start` to the end of the file, in blocks."""
        if self._handle is None:
            yield from self._gzip_blocks(start)
            return
        while block := self._handle.read_at(READ_BLOCK_BYTES, start):
            start += len(block)
            yield block

    def read_at(self, start: int, size: int) -> bytes:
        """`size` bytes from offset `start`; uncompressed files only (units that start mid-file)."""
        return self._handle.read_at(size, start)

    def head(self, size: int) -> bytes:
        """The first `size` bytes of the (decompressed) text, fewer if the file is shorter."""
        if self._handle is not None:
            return self._handle.read_at(size, 0)
        data = b""
        for block in self._gzip_blocks(0):
            data += block[:size - len(data)]
            if len(data) >= size:
                break
        return data

    def _gzip_blocks(self, start: int) -> Iterator[bytes]:
        try:
            with self._fs.open_input_stream(self._path, compression="gzip") as stream:
                # gzip cannot seek: decompress from the beginning and drop what precedes `start`.
                while start > 0 and (dropped := stream.read(min(start, READ_BLOCK_BYTES))):
                    start -= len(dropped)
                while block := stream.read(READ_BLOCK_BYTES):
                    yield block
        except OSError as err:
            raise UserError(f"{self.file.uri}: cannot decompress it as gzip ({err}); recompress "
                            f"it, or drop the .gz suffix if it is not compressed") from err


def _binary_reason(head: bytes) -> str | None:
    """Why a file whose text starts with `head` is binary, or None if it is text."""
    for bom, encoding in _WIDE_BOMS:
        if head.startswith(bom):
            return f"{encoding} text (byte-order mark), not UTF-8"
    if b"\0" in head:
        return (f"NUL bytes in its first {BINARY_CHECK_BYTES} bytes (binary, as git and grep "
                f"decide; or UTF-16 text without a byte-order mark)")
    return None


def binary_reason(file: InputFile) -> str | None:
    """Why `read_unit` skips this text or JSONL file as binary (a NUL byte in its first
    BINARY_CHECK_BYTES, decompressed; or a UTF-16/UTF-32 byte-order mark), or None."""
    if file.format == "parquet":
        return None
    with _Source(file) as source:
        return _binary_reason(source.head(BINARY_CHECK_BYTES))


def _without_bom(blocks: Iterator[bytes]) -> tuple[int, Iterator[bytes]]:
    """A file's blocks without a leading UTF-8 byte-order mark, and the bytes the mark took."""
    first = next(blocks, b"")
    skip = len(_BOM) if first.startswith(_BOM) else 0
    # Through a list iterator, which lets go of the first block once past it.
    return skip, chain(iter([first[skip:]]), blocks)


# ---------------------------------------------------------------- lines
@dataclass
class _Line:
    """A line longer than a block (in file format: the whole file), gathered from fragments."""

    start: int            # offset of its first byte
    size: int             # bytes, without the line end
    space_only: bool      # empty or only ASCII whitespace: a blank line between paragraphs
    data: bytes | None    # its bytes; None when too long to hold, and then the verdicts:
    bad_utf8: bool = False
    blank: bool = True    # its text is empty or whitespace (Unicode)


class _Utf8Check:
    """Verdicts on bytes too long to hold, fed in chunks: valid UTF-8? only whitespace?"""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.bad_utf8 = False
        self.blank = True

    def feed(self, data: bytes, final: bool = False) -> None:
        for begin in range(0, len(data), _CHECK_STEP_BYTES):
            self._step(data[begin:begin + _CHECK_STEP_BYTES], False)
        if final:
            self._step(b"", True)

    def _step(self, data: bytes, final: bool) -> None:
        if self.bad_utf8:
            return  # one invalid byte decides it
        try:
            text = self._decoder.decode(data, final)
        except UnicodeDecodeError:
            self.bad_utf8, self.blank = True, False  # the repair, U+FFFD, is not whitespace
            return
        self.blank = self.blank and _is_blank(text)


def _first_line(source: _Source, start: int) -> tuple[int, int]:
    """The offset and 1-based number of the first line that begins at or after `start`.

    Numbering counts the newlines before it, which reads the file up to `start` once more.
    """
    if start == 0:
        return 0, 1
    offset = start - 1  # a line begins at `start` only if the byte before it is "\n"
    for block in source.blocks(offset):
        newline = block.find(b"\n")
        if newline >= 0:
            offset += newline + 1
            break
        offset += len(block)
    newlines = sum(source.read_at(begin, min(READ_BLOCK_BYTES, offset - begin)).count(b"\n")
                   for begin in range(0, offset, READ_BLOCK_BYTES))
    return offset, newlines + 1


def _line_before_is_blank(source: _Source, start: int) -> bool:
    """Whether the line that ends just before `start` (a line start > 0) is blank, reading
    backwards only until a byte decides it."""
    end = start - 1  # its "\n"
    while end > 0:
        begin = max(0, end - READ_BLOCK_BYTES)
        block = source.read_at(begin, end - begin)
        newline = block.rfind(b"\n")
        tail = block[newline + 1:]
        if newline < 0 and begin == 0:
            tail = tail.removeprefix(_BOM)  # the file's first line: the mark is not text
        if tail and not tail.isspace():
            return False
        if newline >= 0:
            return True
        end = begin
    return True


def _line_chunks(source: _Source, start: int) -> Iterator[tuple[int, bytes, bool]]:
    """The text from offset `start` (a line start) as (offset, chunk, ends a line), in order.

    Mostly a chunk is the run of whole lines that a block completes, each with its line end,
    at the offset of its first byte; the file's last line gets a "\\n" if it has none. A line
    longer than a block comes in fragments, the last with its line end, all at the line's
    offset, so no line is ever held whole: group chunks by offset.
    """
    blocks = source.blocks(start)
    skip = 0
    if start == 0:
        skip, blocks = _without_bom(blocks)
    offset, pending = start + skip, b""  # `offset`: where `pending` begins
    long_line = None  # the offset of a line passed on in fragments, while its end is unread
    for block in blocks:
        data = pending + block
        begin = 0
        if long_line is not None and (newline := data.find(b"\n")) >= 0:
            begin = newline + 1
            yield long_line, data[:begin], True
            long_line = None
        if long_line is None and (last := data.rfind(b"\n") + 1) > begin:
            yield offset + begin, data[begin:last], True
            begin = last
        if len(data) - begin >= READ_BLOCK_BYTES:
            # A long line: pass it on now, but keep a final "\r", which may be half a "\r\n".
            long_line = offset + begin if long_line is None else long_line
            cut = len(data) - 1 if data.endswith(b"\r") else len(data)
            yield long_line, data[begin:cut], False
            begin = cut
        pending = data[begin:]
        offset += begin
    if pending:
        yield offset if long_line is None else long_line, pending + b"\n", True


def _line_runs(source: _Source, start: int, end: float, keep: int,
               ) -> Iterator[tuple[int, bytes | _Line, int]]:
    """The lines from offset `start` (a line that begins before `end`) as (offset, lines,
    owned bytes); the caller numbers them, which costs it less than counting newlines here.

    `lines` is a run of whole lines, each with its line end, or a line longer than a block
    as a _Line (held if at most `keep` bytes). The owned bytes are the ones at its start that
    hold lines beginning before `end` (a _Line: 1 if it does, else 0); the first line always
    does, even when a byte-order mark puts its text past `end`.
    """
    first = True
    for offset, chunks in groupby(_line_chunks(source, start), key=itemgetter(0)):
        room = max(end - offset, 1) if first else end - offset
        _, data, ends_line = next(chunks)
        if ends_line:
            yield offset, data, _owned_bytes(data, room)
        else:
            yield offset, _gather(offset, _fragments(data, chunks), keep), room > 0
        first = False


def _owned_bytes(lines: bytes, room: float) -> int:
    """How many bytes at the start of `lines` (whole lines) hold the lines that begin in its
    first `room` bytes."""
    if room >= len(lines):
        return len(lines)
    return lines.find(b"\n", room - 1) + 1 if room > 0 else 0


def _fragments(first: bytes, chunks: Iterable[tuple[int, bytes, bool]]) -> Iterator[bytes]:
    """A long line's fragments, its line end left out."""
    yield first
    for _, data, ends_line in chunks:
        yield data[:-1].removesuffix(b"\r") if ends_line else data


def _gather(start: int, chunks: Iterable[bytes], keep: int) -> _Line:
    """A line from its chunks: kept if at most `keep` bytes in all, else checked as they pass."""
    kept: list[bytes] = []
    size, space_only, check = 0, True, None
    for chunk in chunks:
        size += len(chunk)
        space_only = space_only and (not chunk or chunk.isspace())
        if check is not None:
            check.feed(chunk)
            continue
        kept.append(chunk)
        if size > keep:
            check = _Utf8Check()
            for part in kept:
                check.feed(part)
            kept = []
    if check is None:
        return _Line(start, size, space_only, b"".join(kept))
    check.feed(b"", final=True)
    return _Line(start, size, space_only, None, check.bad_utf8, check.blank)


def _lf(data: bytes) -> bytes:
    """Whole lines with "\\n" line ends: the "\\r" of a "\\r\\n" is part of the line end."""
    # Looking for one byte is some 50x faster than for two, and most files have no "\r".
    return data.replace(b"\r\n", b"\n") if b"\r" in data else data


def _owned_lines(source: _Source, unit: WorkUnit, keep: int,
                 ) -> Iterator[tuple[int, bytes | _Line]]:
    """The lines that begin in the unit's range as (number, line): its bytes without the line
    end, or a line longer than a block as a _Line (held if at most `keep` bytes)."""
    start, number = _first_line(source, unit.start)
    end = _owned_end(unit)
    if start >= end:
        return
    for _, lines, owned in _line_runs(source, start, end, keep):
        if isinstance(lines, _Line):
            if not owned:
                return
            yield number, lines
            number += 1
            continue
        if owned:
            split = _lf(lines[:owned]).split(b"\n")
            split.pop()  # after the last line end
            yield from enumerate(split, number)
            number += len(split)
        if owned < len(lines):
            return


# ---------------------------------------------------------------- plain text and JSONL
# A "\n" and the blank lines after it (empty, or only ASCII whitespace, "\r" included), which
# end a paragraph. Starting with a plain "\n" lets the regex engine skip ahead to each "\n"
# (an optional "\r" first would make it try every byte, 8x slower), so the "\r" of a "\r\n"
# before it stays with the paragraph.
_PARAGRAPH_END = re.compile(rb"\n[ \t\r\x0b\x0c]*\n(?:[ \t\r\x0b\x0c]*\n)*")
# The blank lines at the start of a run of whole lines.
_LEADING_BLANK_LINES = re.compile(rb"(?:[ \t\r\x0b\x0c]*\n)*")


class _Document:
    """A document that no run of lines holds whole: it goes on past a run, or has a line longer
    than a block. Keeps its bytes while they fit in one piece; a longer one is checked as its
    parts pass, and read again to cut it into pieces."""

    def __init__(self, start: int, limit: int) -> None:
        self.start = start
        self.size = -1  # bytes with "\n" line ends; no "\n" before the first part
        self.bad_utf8, self.blank = False, True  # the verdicts, once `held` returns it
        self._limit = limit
        self._parts: list[bytes] | None = []
        self._check = _Utf8Check()

    def add(self, part: bytes | _Line) -> None:
        """Append lines after a "\\n": bytes with "\\n" line ends, or a long line."""
        data = part.data if isinstance(part, _Line) else part
        self.size += 1 + (part.size if isinstance(part, _Line) else len(part))
        if self._parts is not None:
            if data is not None and self.size <= self._limit:
                self._parts.append(data)
                return
            self._check.feed(b"\n".join(self._parts))  # too long to hold from now on
            self._parts = None
        self._check.feed(b"\n")  # also ends a character left unfinished, which is invalid
        if data is not None:
            self._check.feed(data)
        else:
            self.bad_utf8 = self.bad_utf8 or part.bad_utf8
            self.blank = self.blank and part.blank

    @classmethod
    def of(cls, line: _Line, limit: int) -> bytes | _Document:
        """A document of one long line: its bytes if it fits in one piece, else its verdicts."""
        document = cls(line.start, limit)
        document.add(line)
        return document.held()

    def held(self) -> bytes | _Document:
        """Its bytes if it fits in one piece; else itself, its verdicts complete."""
        if self._parts is not None:
            return b"\n".join(self._parts)
        self._check.feed(b"", final=True)
        self.bad_utf8 = self.bad_utf8 or self._check.bad_utf8
        self.blank = self.blank and self._check.blank
        return self


def _read_text(source: _Source, unit: WorkUnit, options: ReadOptions,
               counters: ReadCounters) -> Iterator[Piece]:
    limit = options.max_piece_bytes
    if options.text_format == "file":
        whole_file = _gather(0, _without_bom(source.blocks(0))[1], limit)
        documents: Iterable[tuple[int, bytes | _Line | _Document]] = [(1, whole_file)]
    elif options.text_format == "lines":
        documents = _owned_lines(source, unit, limit)
    else:
        documents = _paragraphs(source, unit, limit)
    for line, document in documents:
        where = f"{unit.file.uri}:{line}"
        if not isinstance(document, bytes):
            yield from _long_pieces(source, document, where, options, counters)
            continue
        try:
            text = document.decode()
        except UnicodeDecodeError:
            text = ""  # not the usual case: _pieces repairs it
        if text and len(document) <= limit and not text.isspace():
            # The usual document, valid and one piece, done inline: this runs once a line or
            # paragraph, and the calls of the general path would add a quarter to its time.
            counters.documents += 1
            counters.utf8_bytes += len(document)
            yield Piece(text, where, True, True)
        else:
            text, bad_utf8 = _decode(document)
            yield from _pieces(text, document, bad_utf8, where, options, counters)


def _long_pieces(source: _Source, document: _Line | _Document, where: str, options: ReadOptions,
                 counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document that no run of lines holds whole: a long paragraph, checked as
    it passed, or a line longer than a block (in file format: the file)."""
    if isinstance(document, _Line):
        document = _Document.of(document, options.max_piece_bytes)
        if isinstance(document, bytes):
            text, bad_utf8 = _decode(document)
            return _pieces(text, document, bad_utf8, where, options, counters)
    if not _keep(document.bad_utf8, document.blank, options, counters):
        return ()
    texts = _split_pieces(_document_bytes(source, document, options.text_format),
                          options.max_piece_bytes)
    return _flagged(texts, where, counters)


def _owned_end(unit: WorkUnit) -> float:
    """Where the unit's documents stop beginning. A gzip unit is the whole file: its end is in
    compressed bytes, which do not compare with offsets in the decompressed text."""
    return math.inf if unit.file.compression else unit.end


def _paragraphs(source: _Source, unit: WorkUnit, limit: int,
                ) -> Iterator[tuple[int, bytes | _Document]]:
    """The paragraphs whose first line begins in the unit's range, as (line number, bytes or a
    long _Document)."""
    start, number = _first_line(source, unit.start)
    end = _owned_end(unit)
    if start >= end:
        return
    # Unless a blank line ends just before it, the first line goes on with a paragraph that an
    # earlier unit owns.
    continued = start > 0 and not _line_before_is_blank(source, start)
    paragraph, first_line = None, 0  # a paragraph that goes on past the run before
    for offset, lines, owned in _line_runs(source, start, end, limit):
        after_blank, parts, next_number = _paragraph_parts(lines, number)
        if after_blank:
            if paragraph is not None:
                yield first_line, paragraph.held()
            paragraph, continued = None, False
        for begin, line, part, ended in parts:
            if continued:
                continued = not ended
                continue
            if paragraph is None:
                if begin >= owned:
                    return
                if ended:  # the usual case: the whole paragraph is in the run
                    yield line, part
                    continue
                paragraph, first_line = _Document(offset + begin, limit), line
            paragraph.add(part)
            if ended:
                yield first_line, paragraph.held()
                paragraph = None
        number = next_number
    if paragraph is not None:
        yield first_line, paragraph.held()


def _paragraph_parts(lines: bytes | _Line, number: int,
                     ) -> tuple[bool, list[tuple[int, int, bytes | _Line, bool]], int]:
    """How a run of whole lines (or a long line) from line `number` divides: whether it starts
    with a blank line; its stretches of non-blank lines as (position, line number, bytes with
    "\\n" line ends, whether a blank line ends it in the run); the number of the line after it."""
    parts: list[tuple[int, int, bytes | _Line, bool]] = []
    if isinstance(lines, _Line):
        if not lines.space_only:
            parts.append((0, number, lines, False))
        return lines.space_only, parts, number + 1
    begin = _LEADING_BLANK_LINES.match(lines).end()
    after_blank, number = begin > 0, number + lines.count(b"\n", 0, begin)
    crlf = b"\r" in lines  # else the parts need no line ends changed
    for match in _PARAGRAPH_END.finditer(lines, begin):
        end, after = match.span()
        part = lines[begin:end]
        parts.append((begin, number, _lf(part).removesuffix(b"\r") if crlf else part, True))
        number += lines.count(b"\n", begin, after)
        begin = after
    if begin < len(lines):
        parts.append((begin, number, _lf(lines[begin:])[:-1], False))
        number += lines.count(b"\n", begin)
    return after_blank, parts, number


def _document_bytes(source: _Source, document: _Document, text_format: TextFormat,
                    ) -> Iterator[bytes]:
    """A long document's bytes, read again: the text from its start with "\\n" line ends, up
    to its size; or the whole file."""
    if text_format == "file":
        yield from _without_bom(source.blocks(0))[1]
        return
    left = document.size
    for _, chunk, _ in _line_chunks(source, document.start):
        chunk = _lf(chunk)  # a fragment has no "\n", so no "\r\n" either
        if len(chunk) >= left:
            yield chunk[:left]
            return
        yield chunk
        left -= len(chunk)


def _read_jsonl(source: _Source, unit: WorkUnit, options: ReadOptions,
                counters: ReadCounters) -> Iterator[Piece]:
    for number, line in _owned_lines(source, unit, MAX_JSONL_LINE_BYTES):
        data, space_only = ((line.data, line.space_only) if isinstance(line, _Line) else
                            (line, not line or line.isspace()))
        if space_only:
            continue
        where = f"{unit.file.uri}:{number}"
        text, problem = _json_text(data, options.text_field)
        if problem is not None:
            if options.bad_json == "error":
                raise UserError(f"{where}: {problem}; pass --bad-json skip to skip such lines "
                                f"and count them")
            counters.bad_json_skipped += 1
            continue
        text, data, bad_utf8 = _repair_surrogates(text)
        yield from _pieces(text, data, bad_utf8, where, options, counters)


def _json_text(data: bytes | None, field: str) -> tuple[str, None] | tuple[None, str]:
    """The text field of a JSONL line (None: too long to hold), or None and what is wrong."""
    if data is None:
        return None, (f"line longer than {MAX_JSONL_LINE_BYTES >> 20} MiB; JSONL holds one "
                      f"JSON object per line")
    try:
        # Invalid UTF-8 becomes lone surrogates, which --bad-utf8 handles if in the text field.
        record = _json_value(data.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {_JSON_TYPES[type(record)]}"
    if field not in record:
        present = ", ".join(map(repr, record)) or "none"
        return None, f"no field {field!r} (fields: {present}); choose one with --text-field"
    if not isinstance(record[field], str):
        return None, (f"field {field!r} is {_JSON_TYPES[type(record[field])]}, not a string; "
                      f"choose the text field with --text-field")
    return record[field], None


def _json_value(line: str) -> object:
    """json.loads(line), twice as fast for the usual line: a value and nothing around it."""
    try:
        value, end = _JSON.raw_decode(line)  # what json.loads does, less its wrapping
        if end == len(line):
            return value
    except json.JSONDecodeError:
        pass
    return json.loads(line)  # its value or error, whatever raw_decode made of the line


def _repair_surrogates(text: str) -> tuple[str, bytes, bool]:
    """A JSON string with its lone surrogates (invalid UTF-8 bytes, or escapes like "\\udc80")
    replaced by U+FFFD, its UTF-8 bytes, and whether it had any."""
    try:
        return text, text.encode(), False  # only a surrogate fails to encode: none to look for
    except UnicodeEncodeError:
        repaired = _SURROGATES.sub("\ufffd", text)
        return repaired, repaired.encode(), True


# ---------------------------------------------------------------- Parquet
def _read_parquet(unit: WorkUnit, options: ReadOptions,
                  counters: ReadCounters) -> Iterator[Piece]:
    fs, path = _filesystem(unit.file.uri)
    with fs.open_input_file(path) as handle:
        parquet = _parquet_file(handle, unit.file)
        _check_text_column(parquet, unit.file, options.text_column)
        row = sum(parquet.metadata.row_group(group).num_rows for group in range(unit.start))
        batches = parquet.iter_batches(row_groups=list(range(unit.start, unit.end)),
                                       columns=[options.text_column])
        for batch in batches:
            column = batch.column(0)
            # As bytes: Parquet readers do not check that strings are UTF-8; --bad-utf8 decides.
            for value in column.view(_TEXT_COLUMN_TYPES[column.type]).to_pylist():
                value = value or b""  # null counts as empty
                text, bad_utf8 = _decode(value)
                # Cut like a JSON string: the repaired text's bytes.
                yield from _pieces(text, text.encode() if bad_utf8 else value, bad_utf8,
                                   f"{unit.file.uri}#row={row}", options, counters)
                row += 1


def _parquet_file(handle: pa.NativeFile, file: InputFile) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(handle)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{file.uri}: not a readable Parquet file ({err})") from err


def _check_text_column(parquet: pq.ParquetFile, file: InputFile, column: str) -> None:
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise UserError(f"{file.uri}: no column {column!r} (columns: {', '.join(schema.names)}); "
                        f"choose the text column with --text-column")
    if schema.field(column).type not in _TEXT_COLUMN_TYPES:
        raise UserError(f"{file.uri}: column {column!r} holds {schema.field(column).type}, not "
                        f"text; choose a string column with --text-column")


# ---------------------------------------------------------------- documents to pieces
def _decode(data: bytes) -> tuple[str, bool]:
    """The text of UTF-8 bytes, invalid ones replaced by U+FFFD, and whether there were any."""
    try:
        return data.decode(), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def _is_blank(text: str) -> bool:
    return not text or text.isspace()


def _keep(bad_utf8: bool, blank: bool, options: ReadOptions, counters: ReadCounters) -> bool:
    """Whether to yield a document, per --bad-utf8 and the empty-document rule; counts it."""
    if bad_utf8 and options.bad_utf8 == "skip":
        counters.bad_utf8_skipped += 1
        return False
    if blank:
        counters.empty_skipped += 1
        return False
    counters.bad_utf8_repaired += bad_utf8
    return True


def _pieces(text: str, data: bytes, bad_utf8: bool, source: str, options: ReadOptions,
            counters: ReadCounters) -> Iterable[Piece]:
    """The pieces of a document held in memory, if kept: `text` whole if `data`, its bytes
    (in plain text: before any repair), fit in one piece, else `data` cut into pieces. A plain
    function, not a generator: most documents are one piece, and it runs once per document."""
    if not _keep(bad_utf8, _is_blank(text), options, counters):
        return ()
    if len(data) > options.max_piece_bytes:
        return _flagged(_split_pieces([data], options.max_piece_bytes), source, counters)
    counters.documents += 1
    counters.utf8_bytes += len(text.encode()) if bad_utf8 else len(data)
    return (Piece(text, source, True, True),)


def _split_pieces(chunks: Iterable[bytes], limit: int) -> Iterator[str]:
    """A long document's text, from its bytes, in pieces of at most `limit` of those bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # one decoder: pieces join exactly
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        while len(buffer) > limit:
            cut = _cut_point(buffer, limit)
            # Empty only if the piece is just the start of an invalid sequence, which the
            # decoder holds for the next piece.
            if text := decoder.decode(buffer[:cut]):
                yield text
            del buffer[:cut]
    yield decoder.decode(buffer, final=True)


def _cut_point(data: bytearray, limit: int) -> int:
    """Where to end a piece within data[:limit]: after its last newline, else after its last
    space or tab, else before the character that straddles `limit`."""
    newline = data.rfind(b"\n", 0, limit)
    if newline >= 0:
        return newline + 1
    space = max(data.rfind(b" ", 0, limit), data.rfind(b"\t", 0, limit))
    if space >= 0:
        return space + 1
    cut = limit
    # Back up over UTF-8 continuation bytes (10xxxxxx); a valid character has at most 3.
    while cut > limit - 3 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _flagged(texts: Iterable[str], source: str, counters: ReadCounters) -> Iterator[Piece]:
    """A document's pieces with their first/last flags; counts the document and its bytes."""
    pieces = iter(texts)
    current, first = next(pieces), True
    for following in pieces:
        counters.utf8_bytes += len(current.encode())
        yield Piece(current, source, first, False)
        current, first = following, False
    counters.documents += 1
    counters.utf8_bytes += len(current.encode())
    yield Piece(current, source, first, True)

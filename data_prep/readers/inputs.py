"""Input resolution: the files that the ``--input`` patterns name, and how to read each one.

Patterns are local paths or URIs of any pyarrow filesystem; a file's format and compression
come from its name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from common.atomic_files import special_kind
from common.errors import UserError

__all__ = ["FileFormat", "InputFile", "filesystem", "local_roots", "resolve_inputs"]

FileFormat = Literal["text", "jsonl", "parquet"]

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


@dataclass(frozen=True)
class InputFile:
    """One input file: where it is, how to read it."""

    uri: str                           # absolute local path, or a pyarrow-filesystem URI
    format: FileFormat
    compression: Literal["gzip"] | None
    size: int                          # bytes on storage


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


def local_roots(patterns: Sequence[str]) -> list[str]:
    """The local files and directories that ``patterns`` read from: each pattern itself, or the
    directory a glob searches; URIs of other filesystems are left out. An output must keep
    clear of them (``common.outputs.InputPath``)."""
    roots = []
    for pattern in patterns:
        if "://" in pattern and not pattern.startswith("file://"):
            continue
        pattern = pattern.removeprefix("file://")
        glob = _GLOB_CHARS.search(pattern)
        roots.append(pattern if glob is None else pattern[:pattern.rfind("/", 0, glob.start()) + 1] or ".")
    return roots


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds `uri` and the path inside it; a plain path is local."""
    try:
        return pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{uri}: not a local path or a URI that pyarrow can open ({err})") from err


def _expand(pattern: str) -> list[InputFile]:
    """The files one pattern names; a UserError if it names none."""
    glob = _GLOB_CHARS.search(pattern)
    root = pattern if glob is None else pattern[:pattern.rfind("/", 0, glob.start()) + 1]
    fs, path = filesystem(root or ".")
    if glob is not None:
        matches = _matching_files(fs, path, pattern[len(root):])
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            matches = [info]
        elif info.type == pafs.FileType.Directory:
            matches = _matching_files(fs, path, "**")
        else:
            raise UserError(_not_a_file(fs, path, pattern))
    if not matches:
        raise UserError(f"{pattern}: matches no files (hidden files are left out)")
    prefix = _uri_prefix(fs, root or ".", path)
    return [_input_file(prefix + match.path, match.size) for match in matches]


def _not_a_file(fs: pafs.FileSystem, path: str, pattern: str) -> str:
    """Why ``pattern``, neither a file nor a directory, is no input: missing, or (a local path)
    a device, a FIFO or a socket, which a prep cannot read by byte ranges, nor read again."""
    try:
        kind = special_kind(os.stat(path).st_mode) if isinstance(fs, pafs.LocalFileSystem) else None
    except OSError:
        kind = None
    if kind is None:
        return f"{pattern}: no such file or directory"
    return (f"{pattern}: is {kind}, not a file or a directory; prep reads its inputs by byte ranges, some twice: "
            f"save what it gives to a file and give that file")


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

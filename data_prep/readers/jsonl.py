"""JSON lines: one object per line, its text field the document; blank lines are allowed.

A line is parsed whole (a document is not streamed in pieces until it is parsed), so a line
over MAX_JSONL_LINE_BYTES is refused as not JSONL.
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from common.errors import UserError, json_problem
from data_prep.readers.byte_source import ByteSource
from data_prep.readers.lines import Line, owned_lines
from data_prep.readers.options import ReadOptions
from data_prep.readers.pieces import Piece, ReadCounters, pieces
from data_prep.readers.planning import WorkUnit

__all__ = ["MAX_JSONL_LINE_BYTES", "read_jsonl"]

# A JSONL line is parsed whole. A line this long is not a document but a file that is not JSONL
# (one big JSON array, say); stopping here fails it before it exhausts a worker's memory.
MAX_JSONL_LINE_BYTES = 256 << 20

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}
_SURROGATES = re.compile("[\ud800-\udfff]")
_JSON = json.JSONDecoder()  # as json.loads makes it


def read_jsonl(source: ByteSource, unit: WorkUnit, options: ReadOptions,
               counters: ReadCounters) -> Iterator[Piece]:
    """The pieces of the JSONL records whose lines begin in `unit`, in file order; fills
    `counters`. A broken line stops the read or is skipped, per `options.bad_json`."""
    origin = f"{unit.file.uri}:"  # then the line's number
    for number, line in owned_lines(source, unit, MAX_JSONL_LINE_BYTES):
        data, space_only = ((line.data, line.space_only) if isinstance(line, Line) else
                            (line, not line or line.isspace()))
        if space_only:
            continue
        text, problem = _json_text(data, options.text_field)
        if problem is not None:
            if options.bad_json == "error":
                raise UserError(f"{origin}{number}: {problem}; pass --bad-json skip to skip such lines "
                                f"and count them")
            counters.bad_json_skipped += 1
            continue
        text, data, bad_utf8 = _repair_surrogates(text)
        yield from pieces(text, data, bad_utf8, origin, number, options, counters)


def _json_text(data: bytes | None, field: str) -> tuple[str, None] | tuple[None, str]:
    """The text field of a JSONL line (None: too long to hold), or None and what is wrong."""
    if data is None:
        return None, (f"line longer than {MAX_JSONL_LINE_BYTES >> 20} MiB; JSONL holds one "
                      f"JSON object per line")
    try:
        # Invalid UTF-8 becomes lone surrogates, which --bad-utf8 handles if in the text field.
        record = _json_value(data.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({json_problem(err)})"
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

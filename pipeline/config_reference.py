"""The configuration reference of the manual (``docs/training.md``), generated from the typed sections.

Each field's meaning is the comment written next to it (or just above it) in
``pipeline/config.py``, so the reference cannot drift from the code: ``make docs`` and a test
compare the page with ``reference_markdown()``. ``python -m pipeline.config_reference`` prints
the table; ``--write`` rewrites it in the page, between its markers.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from pipeline.config import RESUME_SAFE, Config

__all__ = ["reference_markdown", "write_reference", "field_comments", "field_docs", "FieldDoc"]

_FIELD = re.compile(r"^\s+(\w+)\s*:")
_COMMENT_ONLY = re.compile(r"^\s*#\s?(.*)$")
# The generated table in a page: between these two comments.
_MARKED = re.compile(r"<!-- config-reference:[^\n]*-->\n(.*?)<!-- end config-reference -->", flags=re.S)


def _trailing_comment(line: str) -> str:
    """The ``# ...`` at the end of a code line (not inside a string literal)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#":
            return line[i + 1:].strip()
    return ""


def field_comments(section: type) -> dict[str, str]:
    """Field name -> the comment above it and at the end of its line, joined."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(section).splitlines()[1:]:
        if comment := _COMMENT_ONLY.match(line):
            pending.append(comment.group(1).strip())
        elif match := _FIELD.match(line):
            comments[match.group(1)] = " ".join([*pending, _trailing_comment(line)]).strip()
            pending = []
        else:
            pending = []
    return comments


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One config field as a user reads about it."""

    name: str            # "section.field"
    type: str
    default: str         # as JSON
    meaning: str         # the comment next to the field in pipeline/config.py
    resume_safe: bool    # may change when a run resumes


def field_docs() -> list[FieldDoc]:
    """Every field of every section, in declaration order."""
    docs = []
    for section in dataclasses.fields(Config):
        comments = field_comments(section.default_factory)
        for field in dataclasses.fields(section.default_factory):
            resume_safe = all(field.metadata.get(key) == value for key, value in RESUME_SAFE.items())
            docs.append(FieldDoc(f"{section.name}.{field.name}", str(field.type), json.dumps(_default(field)),
                                 comments.get(field.name, ""), resume_safe))
    return docs


def reference_markdown() -> str:
    """The reference table: every field of every section, its type, default and meaning."""
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for doc in field_docs():
        safe = " (may change on resume)" if doc.resume_safe else ""
        lines.append(f"| `{doc.name}` | `{_cell(doc.type)}` | `{_cell(doc.default)}` | {_cell(doc.meaning)}{safe} |")
    return "\n".join(lines) + "\n"


def write_reference(page: Path) -> None:
    """Replace the table between the page's config-reference markers with the generated one."""
    text = page.read_text(encoding="utf-8")
    match = _MARKED.search(text)
    if not match:
        raise SystemExit(f"{page}: no <!-- config-reference: ... --> ... <!-- end config-reference --> markers")
    page.write_text(text[:match.start(1)] + reference_markdown() + text[match.end(1):], encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference(Path(__file__).resolve().parent.parent / "docs" / "training.md")
    else:
        print(reference_markdown(), end="")

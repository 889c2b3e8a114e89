"""A corpus that needs no download: the documentation text inside every CPython install.

Two sources, both plain English prose about Python, about 1.3 MB on CPython 3.11:

- ``pydoc_data.topics``: the language reference topics behind ``help("if")``;
- the docstrings of the standard library's top-level modules (their classes and
  functions too), read with ``ast`` from the source files, so nothing is imported.

Each topic and each docstring is one document. The text is a function of the Python
version only, so the demo (``unmask run`` with no ``--input``) is reproducible on one
version and needs neither network nor data files.
"""

from __future__ import annotations

import ast
import json
import platform
import sysconfig
from pathlib import Path
from typing import Iterator

from common.atomic_files import atomic_write_bytes

__all__ = ["cpython_documents", "write_cpython_corpus", "CORPUS_TEXT_FIELD"]

CORPUS_TEXT_FIELD = "text"
# Docstrings shorter than this are signatures or one-word notes, not prose.
MIN_DOCSTRING_CHARS = 40
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip()


def _docstrings(source: Path) -> Iterator[str]:
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a test fixture of the stdlib that is deliberately not valid Python
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and (text := ast.get_docstring(node)):
            if len(text) >= MIN_DOCSTRING_CHARS:
                yield text


def cpython_documents() -> Iterator[str]:
    """The documents, in a fixed order: reference topics, then docstrings by module name."""
    yield from _topics()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py")):
        yield from _docstrings(source)


def write_cpython_corpus(out_dir: str | Path) -> Path:
    """Write the corpus as JSONL (field ``text``) into ``out_dir``, once; its path."""
    path = Path(out_dir) / f"cpython-{platform.python_version()}-docs.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (json.dumps({CORPUS_TEXT_FIELD: text}, ensure_ascii=False) for text in cpython_documents())
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return path

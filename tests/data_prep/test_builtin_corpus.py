"""The built-in corpus (``data_prep.builtin_corpus``): the documentation text inside CPython,
Python prose in a fixed order, big enough to train the demo of ``unmask run`` on."""

from __future__ import annotations

import json

from data_prep.builtin_corpus import MIN_DOCSTRING_CHARS, cpython_documents, write_cpython_corpus

# The corpus must be big enough to train the demo on (pydoc topics alone are ~0.47 MB).
MIN_CORPUS_CHARS = 1_000_000


def test_builtin_corpus_is_python_prose_in_a_fixed_order(tmp_path):
    documents = list(cpython_documents())
    assert documents == list(cpython_documents())
    assert sum(map(len, documents)) > MIN_CORPUS_CHARS
    assert all(document.strip() for document in documents)
    assert any("while" in document and "loop" in document for document in documents[:100])  # the reference topics
    assert min(map(len, documents[100:])) >= MIN_DOCSTRING_CHARS

    path = write_cpython_corpus(tmp_path)
    written = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert written == documents
    stamp = path.stat().st_mtime_ns
    assert write_cpython_corpus(tmp_path) == path and path.stat().st_mtime_ns == stamp  # written once


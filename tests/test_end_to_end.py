"""``unmask run``'s own parts: the built-in corpus and the checks made before any work.

The whole pipeline runs end to end (submitted through Ray Jobs, then rerun to see every
stage skipped) in tests/test_jobs.py, and as `make demo` in CI.
"""

from __future__ import annotations

import json

from data_prep.builtin_corpus import MIN_DOCSTRING_CHARS, cpython_documents, write_cpython_corpus
from tests.cli_runner import run_unmask

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


def test_run_checks_its_config_before_doing_anything(tmp_path):
    run_dir = tmp_path / "run"
    missing = run_unmask(["run", "--config", str(tmp_path / "nope.yaml"), "--run-dir", str(run_dir)])
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr
    bad = run_unmask(["run", "--run-dir", str(run_dir), "--train.max_steps", "many"])
    assert bad.returncode == 2 and "train.max_steps" in bad.stderr
    assert not run_dir.exists()

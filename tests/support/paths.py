"""Where the tests find things: this checkout (``REPO``) and the real data beside it in
``../shared/data`` (``SHARED``; what each file is and where it came from: ``SOURCES``).

A test that needs a real file skips, naming the file and ``SOURCES``, when it is absent:
``require_shared`` inside a test or fixture, ``needs_shared`` as a mark. The evaluation sets'
files (``WIKI_TEST``, ...: paths relative to ``SHARED``) and ``real_lines`` of them serve the
datasets' and the detokenizers' tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
SOURCES = SHARED / "SOURCES.md"
TINY = SHARED / "corpora" / "tinyshakespeare" / "input.txt"
PTB = SHARED / "ptb" / "ptb.test.txt"
GPT2 = SHARED / "gpt2-bpe"


def _absent(paths: tuple[Path | str, ...]) -> list[Path]:
    """Those of ``paths`` (relative ones under ``SHARED``) that do not exist."""
    return [SHARED / path for path in paths if not (SHARED / path).exists()]


def _reason(absent: list[Path]) -> str:
    return f"{', '.join(map(str, absent))} {'is' if len(absent) == 1 else 'are'} absent (see {SOURCES})"


def require_shared(*paths: Path | str) -> Path:
    """The first of ``paths`` (relative ones under ``SHARED``); skips the test unless all exist."""
    absent = _absent(paths)
    if absent:
        pytest.skip(_reason(absent))
    return SHARED / paths[0]


def needs_shared(*paths: Path | str) -> pytest.MarkDecorator:
    """A mark that skips the test (or, as ``pytestmark``, the module) unless all of ``paths`` exist."""
    absent = _absent(paths)
    return pytest.mark.skipif(bool(absent), reason=_reason(absent) if absent else "")


# The evaluation sets' files, relative to SHARED.
WIKI_TEST = "wikitext-2-raw/wiki.test.raw"
WIKI_VALID = "wikitext-2-raw/wiki.valid.raw"
PTB_TEST = "ptb/ptb.test.txt"
LAMBADA_TEST = "lambada/lambada_test.jsonl"
LAMBADA_DEV = "lambada/lambada_development_plain_text.txt"
LM1B_TEST = "lm1b/news.en.heldout-00000-of-00050"


def real_lines(relative: str) -> list[str]:
    """The lines of a file under ``SHARED``, without their newlines."""
    return (SHARED / relative).read_text(encoding="utf-8").split("\n")[:-1]


def real_line(relative: str, number: int) -> str:
    return real_lines(relative)[number - 1]

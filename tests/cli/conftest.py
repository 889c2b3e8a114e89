"""Fixtures the command line's tests share: untrained exports of each process, a text file
and a file standing where a directory is expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_refusals import untrained_exports, write_a_file, write_text_file


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    return untrained_exports(tmp_path_factory.mktemp("exports"))


@pytest.fixture
def text_file(tmp_path) -> Path:
    return write_text_file(tmp_path)


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)

"""Progress without a terminal: plain lines a CI log can hold, never carriage returns; log
records written during a bar come out whole, above it."""

from __future__ import annotations

import io
import logging
import sys

from common.progress import bar, bars_and_logs


def test_without_a_terminal_a_bar_prints_whole_lines(monkeypatch):
    stream = io.StringIO()  # not a tty, like a CI log
    monkeypatch.setattr(sys, "stderr", stream)
    with bar(total=5, desc="tokenize", unit="item") as progress:
        for _ in range(5):
            progress.update(1)
    text = stream.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[0].startswith("tokenize:   0%") and lines[-1].startswith("tokenize: 100%")
    assert len(lines) == len(set(lines))  # the final state once


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_log_lines_are_written_above_the_bar_not_through_it(monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(stream)
    logging.root.addHandler(handler)
    try:
        with bar(total=2, desc="train", mininterval=0) as progress, bars_and_logs():
            progress.update(1)
            logging.getLogger("unmask.test_progress").warning("step 1 done")
            progress.update(1)
    finally:
        logging.root.removeHandler(handler)
    before = stream.getvalue().split("step 1 done")[0]
    assert "train:  50%" in before
    assert before.rsplit("\r", 1)[-1].strip() == ""  # the bar was cleared first, the line is whole

"""Progress bars that read well on a terminal and in a CI log alike.

On a terminal a bar redraws in place (tqdm, with rate and ETA). Without one (CI, a Ray job's
log, output piped to a file) carriage returns would pile up into one endless line, so the
bar prints a plain line, with the same rate and ETA, at most every ``PLAIN_EVERY_S``.
``bar(...)`` is the one way a loop over more than a few seconds shows progress; log lines
printed while a bar is open go above it (``logging_redirect_tqdm``) instead of through it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["bar", "bars_and_logs", "PLAIN_EVERY_S"]

PLAIN_EVERY_S = 30.0   # a line this often in a log without a terminal


class _Lines:
    """A stream for tqdm that turns each redraw into one plain line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").replace("\x1b[A", "").strip()
        if line and line != self._last:  # tqdm redraws the final state once more on close
            self.stream.write(line + "\n")
            self._last = line

    def flush(self) -> None:
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
        disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr: redrawn on a terminal, a line every ``PLAIN_EVERY_S`` elsewhere."""
    stream = sys.stderr
    if not _is_terminal(stream):
        kwargs = {"mininterval": PLAIN_EVERY_S, "ascii": True, **kwargs}
        stream = _Lines(stream)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, file=stream,
                dynamic_ncols=True, **kwargs)


@contextmanager
def bars_and_logs() -> Iterator[None]:
    """Within the block, log records are written above the open bars, not through them."""
    with logging_redirect_tqdm():
        yield

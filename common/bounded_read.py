"""Reading a file that is small by nature (a config, a manifest, a marker) whole, up to a limit.

A path may name anything: ``/dev/zero``, a FIFO, a file of gigabytes given by mistake. A
reader reads at most its limit (and one byte more, to tell a file of exactly the limit from
a longer one), so a wrong path costs one line (``TooLarge``), never the machine's memory.
Each reader names its limit: ``pipeline.config.MAX_CONFIG_BYTES``,
``data_prep.shards.format.MAX_MANIFEST_BYTES``, ``common.outputs.MAX_RECORD_BYTES``. The
manual: docs/troubleshooting.md.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from common.errors import UserError
from common.units import GIB, MIB

__all__ = ["TooLarge", "read_bounded"]


class TooLarge(UserError):
    """A file is larger than its reader's limit: not the file it should be."""


def _size(limit: int) -> str:
    for unit, name in ((GIB, "GiB"), (MIB, "MiB")):
        if limit >= unit and limit % unit == 0:
            return f"{limit // unit} {name}"
    return f"{limit:,} bytes"


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (what ``open`` reaches: a file, a device, a pipe), or ``TooLarge``
    naming it when it holds more than ``limit`` bytes; ``what`` names the file in that message
    ("a config file"). OSError as ``open`` and ``read`` raise it."""
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        # A file's size is known before reading it; a device or a pipe tells only by being read.
        too_large = stat.S_ISREG(status.st_mode) and status.st_size > limit
        data = b"" if too_large else handle.read(limit + 1)
    if too_large or len(data) > limit:
        raise TooLarge(f"{path}: holds more than {_size(limit)}, the most unmask reads as {what}; check that the "
                       f"path names {what}")
    return data

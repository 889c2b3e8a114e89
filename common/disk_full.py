"""A full disk: how a failed write is recognized as one, and the one line that says so.

Every command that writes turns a write that failed for want of space into ``DiskFull``: one
line naming what it was writing and what is intact, never a traceback (a checkpoint:
``pipeline.run_dir.checkpoint.write_failure``; an output directory or file:
``common.outputs``; a prep: ``data_prep.prep``). ``is_disk_full`` recognizes the failure
however a library reports it. The manual: docs/troubleshooting.md.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from common.errors import UserError

__all__ = ["FULL_DISK_MARGIN", "DiskFull", "is_disk_full"]

# A write that failed on a disk with less than this free failed for want of space: torch's
# zip writer reports a full disk as "unexpected pos", without the OS error.
FULL_DISK_MARGIN = 16 << 20
# What a library that wraps the OS error says (safetensors' SafetensorError, a Ray task's error).
_NO_SPACE = ("No space left on device", "Disk quota exceeded")


class DiskFull(UserError):
    """A write failed for want of space; the message names the file and what is intact."""


def is_disk_full(err: BaseException, directory: Path, *, by_free_space: bool = True) -> bool:
    """Whether ``err``, raised while writing into ``directory``, is a full disk (or quota):
    ENOSPC or EDQUOT, an error that says so (a library's, or a worker's passed on as text), or
    (``by_free_space``: for a caller whose code only writes) any failure but a ``UserError``
    on a disk with less than ``FULL_DISK_MARGIN`` free. A ``DiskFull`` said so already: no."""
    if isinstance(err, DiskFull):
        return False
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(words in str(err) for words in _NO_SPACE):
        return True
    if isinstance(err, UserError) or not by_free_space:
        return False
    for path in (Path(directory), *Path(directory).parents):
        if path.exists():
            return shutil.disk_usage(path).free < FULL_DISK_MARGIN
    return False

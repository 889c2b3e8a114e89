"""One ``unmask sweep`` per sweep directory: an exclusive lock that the driver holds while it runs.

A second sweep on the same ``--out`` would submit the same trials again: each trial's run is
protected by its own trainer lock (``pipeline.run_dir.lock``), so the second trainer is refused,
but that refusal would count as a failed attempt. ``OUT/sweep.lock`` is a POSIX record lock,
released by the kernel however the driver ends; the holder (host, pid, start, command) is in the
file, and a second sweep stops at once naming it. The manual: docs/scaling.md#on-ray.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from common.errors import UserError

__all__ = ["LOCK_NAME", "sweep_lock"]

LOCK_NAME = "sweep.lock"
_TAKEN = (errno.EACCES, errno.EAGAIN)


@contextlib.contextmanager
def sweep_lock(sweep_dir: Path) -> Iterator[None]:
    """Hold ``SWEEP/sweep.lock`` for the block, or raise UserError naming the sweep that holds it."""
    path = sweep_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in _TAKEN:
                raise
            holder = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace").strip() or "another process"
            raise UserError(f"--out {sweep_dir}: another unmask sweep runs on it ({holder}); two sweeps on one "
                            f"directory would train the same trials: wait for it to finish or stop it, or use "
                            f"another --out") from None
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)   # releases the lock

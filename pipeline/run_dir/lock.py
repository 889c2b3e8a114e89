"""One trainer per run directory: an exclusive lock that rank 0 holds for the whole run.

Rank 0 takes ``RUN/train.lock`` (``RunLock.acquire``) before anything is read or written, and
records who holds it (host, pid, start time, command, job); a second trainer stops at once,
naming the holder (:class:`RunDirLocked`). What a caller relies on: the lock is a POSIX record
lock that the trainer process alone holds, released by the kernel however it dies (its
DataLoader workers and children do not inherit it); the file is opened once, and nothing else
in the process may open it (closing any descriptor releases the lock); a restarted worker
group of the same job waits up to ``SAME_JOB_WAIT_S`` for its predecessor. The manual:
docs/training.md#one-trainer-per-run-directory.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from common.errors import UserError
from pipeline.run_dir.layout import RunLayout

__all__ = ["RunLock", "RunDirLocked", "JOB_ID_ENV"]

log = logging.getLogger("unmask.train")

# Set by a launcher for every worker of one job (Ray Train); torchrun sets its own run id.
JOB_ID_ENV = "UNMASK_JOB_ID"
TORCHRUN_JOB_ENV = "TORCHELASTIC_RUN_ID"
SAME_JOB_WAIT_S = 120.0
POLL_S = 0.5
# The lock files this process holds, by (device, inode), with the holder's record: read from
# here, since opening the file to read it would release the lock when closed.
_HELD: dict[tuple[int, int], dict] = {}
# What lockf raises when another process holds the lock.
_TAKEN = (errno.EACCES, errno.EAGAIN)


class RunDirLocked(UserError):
    """Another trainer holds the run directory."""


def _job_id() -> str | None:
    job = os.environ.get(JOB_ID_ENV) or os.environ.get(TORCHRUN_JOB_ENV)
    return job if job and job != "none" else None  # torchrun's default id names no job


class RunLock:
    """The exclusive lock of one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = RunLayout(run_dir).lock
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirLocked` naming the trainer that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + SAME_JOB_WAIT_S
        while self.path.exists() and (holder := _HELD.get(_key(os.stat(self.path)))) is not None:
            # Held by this process (a worker group's previous loop, in another thread): opening
            # the file again, then closing it, would release it; wait for it like another process.
            self._wait_for(holder, deadline)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            self._lock(fd, deadline)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._key = fd, _key(os.fstat(fd))
        _HELD[self._key] = self._write_holder(fd)

    def _wait_for(self, holder: dict, deadline: float) -> None:
        """Wait a poll for ``holder`` when it is this job's previous worker, still exiting (and
        not for longer than ``deadline``); raise :class:`RunDirLocked` naming it otherwise."""
        if _job_id() is None or holder.get("job") != _job_id() or time.monotonic() > deadline:
            raise RunDirLocked(_locked_message(self.path, holder)) from None
        time.sleep(POLL_S)

    def _lock(self, fd: int, deadline: float) -> None:
        holder = None
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno in _TAKEN:
                    holder = _read_holder(fd)
                    self._wait_for(holder, deadline)
                    continue
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                log.warning("%s: this filesystem has no file locks; nothing stops a second trainer "
                            "on this run directory", self.path)
                return
        left = _read_holder(fd)
        if left.get("pid") and left != holder:
            log.info("taking over %s from pid %s on %s, which is no longer running", self.path,
                     left.get("pid"), left.get("host"))

    def _write_holder(self, fd: int) -> dict:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(),
                  "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return record

    def release(self) -> None:
        """Let the next trainer in (the file stays: removing it would race a new holder)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        _HELD.pop(self._key, None)  # last: a waiter of this process opens the file only then
        self._fd = self._key = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _key(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _locked_message(path: Path, holder: dict) -> str:
    who = (f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')}: "
           f"{holder.get('command')})") if holder else "another process (it has not written its name yet)"
    return (f"{path.parent} is being trained by {who}. Two trainers on one run directory overwrite each "
            f"other's checkpoints: wait for it to finish or stop it, or use another --run-dir")

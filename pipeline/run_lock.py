"""One trainer per run directory: an exclusive lock that rank 0 holds for the whole run.

Two trainers writing one run directory overwrite each other's checkpoints and metrics
without either noticing. Rank 0 takes ``RUN/train.lock`` with ``flock`` before anything
is read or written, and records who holds it (host, pid, start time, command, job). A
second trainer finds the lock taken and stops at once, naming the holder.

The kernel releases a ``flock`` when its process dies, however it dies: a lock file whose
lock nobody holds was left by a killed trainer, and the next one takes it over (and says
so). The other ranks of a job take no lock, so torchrun and DeepSpeed ranks are never
locked out; a restarted worker group of the same job (Ray Train, a torchrun restart) may
find its predecessor still exiting, and waits up to ``SAME_JOB_WAIT_S`` for it.

``flock`` works on local disks and on NFSv4 and Lustre mounts that enable it; on a
filesystem without locks the lock is advisory only, and the log says so.
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
from pipeline.run_layout import RunLayout

__all__ = ["RunLock", "RunDirLocked", "JOB_ID_ENV"]

log = logging.getLogger("unmask.train")

# Set by a launcher for every worker of one job (Ray Train); torchrun sets its own run id.
JOB_ID_ENV = "UNMASK_JOB_ID"
TORCHRUN_JOB_ENV = "TORCHELASTIC_RUN_ID"
SAME_JOB_WAIT_S = 120.0
POLL_S = 0.5


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

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirLocked` naming the trainer that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._write_holder(fd)

    def _lock(self, fd: int) -> None:
        holder = None
        deadline = time.monotonic() + SAME_JOB_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                if _job_id() is None or holder.get("job") != _job_id() or time.monotonic() > deadline:
                    raise RunDirLocked(_locked_message(self.path, holder)) from None
                time.sleep(POLL_S)  # the same job's previous worker is still exiting
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                log.warning("%s: this filesystem has no file locks; nothing stops a second trainer "
                            "on this run directory", self.path)
                return
        left = _read_holder(fd)
        if left.get("pid") and left != holder:
            log.info("taking over %s from pid %s on %s, which is no longer running", self.path,
                     left.get("pid"), left.get("host"))

    def _write_holder(self, fd: int) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(),
                  "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Let the next trainer in (the file stays: removing it would race a new holder)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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

"""Writing files so that readers, and a crash, see the old file or the complete new one; and
giving a written tree the modes the user's umask asks for."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

__all__ = ["atomic_write_bytes", "give_default_modes", "replace_directory"]

# The modes open() and mkdir() ask for; the process umask then takes away what the user denies.
_FILE_MODE, _DIRECTORY_MODE = 0o666, 0o777


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, then rename into place."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def give_default_modes(root: str | Path) -> None:
    """Give ``root`` and everything under it the mode a newly created file or directory gets
    under the process umask (0644 and 0755 under the usual 022). Libraries that write through
    private temporary files, safetensors among them, leave 0600, and a copy keeps its
    source's mode: a tree meant to be shared (an export) is made readable as the user's
    other files are."""
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it: put it back at once
    for directory, _, files in os.walk(root):
        os.chmod(directory, _DIRECTORY_MODE & ~umask)
        for name in files:
            path = os.path.join(directory, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, _FILE_MODE & ~umask)


def replace_directory(staging: str | Path, target: str | Path) -> None:
    """Put the finished directory ``staging`` in ``target``'s place (whatever ``target`` held is
    removed), with the modes of ``give_default_modes``: a reader sees the old tree or the
    complete new one, never a half-written one."""
    give_default_modes(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)

"""Writing files so that readers, and a crash, see the old file or the complete new one; and
giving a written tree the modes the user's umask asks for.

A file is written under its temporary name (``temporary_path``: hidden, with the writer's
pid) and renamed; a failed write (a full disk, a signal) removes it, and what a writer
killed in between leaves behind ``remove_temporaries`` clears once no writer of the
directory is left. The rename replaces a file, or a symbolic link (never what the link
points to), and never a device, a FIFO or a socket (``special_kind``): ``/dev/null`` stays
``/dev/null``, even for root."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from common.errors import UserError

__all__ = ["atomic_write_bytes", "give_default_modes", "is_temporary", "remove_temporaries", "special_kind",
           "temporary_path"]

# The modes open() and mkdir() ask for; the process umask then takes away what the user denies.
_FILE_MODE, _DIRECTORY_MODE = 0o666, 0o777
_TEMPORARY = re.compile(r"^\..+\.tmp-\d+$")


def temporary_path(path: str | Path) -> Path:
    """The name ``path`` is written under before it is renamed into place (``.NAME.tmp-PID``)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a ``temporary_path`` name."""
    return _TEMPORARY.match(name) is not None


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Remove the temporary files that killed writers left in ``directory`` (call it when no
    writer of the directory is running); the ones removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    left = [entry for entry in directory.iterdir() if is_temporary(entry.name) and entry.is_file()]
    for entry in left:
        entry.unlink(missing_ok=True)
    return left


# What a path that is neither a file nor a directory is, by the type bits of its mode.
_SPECIAL_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def special_kind(mode: int) -> str | None:
    """What a file of ``mode`` (``os.stat``'s ``st_mode``) is when it is a device, a FIFO or a
    socket ("a character device", ...); None for a file, a directory or a link."""
    return next((kind for is_kind, kind in _SPECIAL_KINDS if is_kind(mode)), None)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, then rename into place; on
    any failure the temporary file goes. A device, FIFO or socket at ``path`` is refused
    (module docstring)."""
    path = Path(path)
    try:
        kind = special_kind(os.lstat(path).st_mode)
    except FileNotFoundError:
        kind = None
    if kind is not None:
        raise UserError(f"{path}: is {kind}, not a file; unmask replaces the files it writes, and never "
                        f"replaces {kind}: move it away, or write elsewhere")
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


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


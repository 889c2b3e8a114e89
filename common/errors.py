"""The one exception type for mistakes a user can fix (bad input, config, paths), and the
checks of output paths that every command makes before any work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix. The message names the file, line, field or flag and the
    fix; the CLI prints it without a traceback and exits non-zero."""


def output_dir(path: str | Path, flag: str) -> Path:
    """Create the local directory ``path`` (given with ``flag``) if needed and check that files
    can be written in it; a UserError naming the flag and the fix otherwise. Returns the Path.

    Called before any work, so that a run directory that is a file, lies below a file, or is
    not writable fails at once rather than after the work whose output it should hold."""
    directory = Path(path)
    try:
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            where = "is a file" if blocker == directory else f"lies below {blocker}, which is a file"
            raise UserError(f"{flag} {path}: {where}, not a directory; choose a directory (it is "
                            f"created if missing)")
        directory.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".unmask-write-check-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror or err}); choose a directory "
                        f"you can write to, or fix its permissions") from None
    return directory


def output_file(path: str | Path, flag: str) -> Path:
    """Check, before any work, that the file ``path`` (given with ``flag``) can be written:
    not a directory, in a directory that exists or can be created and is writable."""
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    try:
        output_dir(file.parent, flag)
    except UserError as err:
        raise UserError(f"{flag} {path}: cannot write this file: "
                        f"{str(err).removeprefix(f'{flag} ')}") from None
    return file

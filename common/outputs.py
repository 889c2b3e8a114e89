"""Output paths: the one owner of every directory, and every file, that a command writes.

Every command that writes a directory goes through this module and relies on its rules (the
reasoning: docs/concepts.md, "Output directories"):

1. ``check_output_dir`` refuses, before any work, a path that is a file, cannot be written, or
   is, contains or lies inside an input of the command (``InputPath``).
2. Each kind of output (``OutputKind``) marks its directory with ``MARKER``. A command writes
   into a new or empty directory, or one marked with its own kind; a directory of its kind that
   another writer filled before the marker (``OutputKind.unmarked``) is taken, and marked.
3. Whole outputs (``new_output_dir``) are written in a hidden sibling and renamed into place:
   their marker records every file's size and sha256, they replace only an output holding
   nothing but those files, unchanged (``OutputKind.carried`` files are carried over), and a
   failure leaves the old one and no trace. ``staged_directory`` does the same, unchecked, for
   a directory inside an output the caller owns.
4. Outputs that grow in place (``claim_output_dir``) are marked before the work, and given back
   (``OutputClaim.abandon``) by a command that fails before writing anything worth keeping.
5. Output files (``check_output_file``, ``write_output_file``) are checked the same way and
   written atomically; a device or a FIFO (``/dev/null``, ``/dev/stdout``, a named pipe) is
   written in place, never replaced, and a block device, a socket or a symbolic link is refused.
6. Nothing is written through a symbolic link: a link where a command writes a file or a
   directory of its own inside an output is refused before any work (``refuse_links``).
7. A write that fails for want of space is one ``DiskFull`` line naming what was being
   written and what is intact (a whole output's staging directory, a file's temporary, go).

Every refusal is one ``UserError`` line: the flag, the path, the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic_files import atomic_write_bytes, give_default_modes, is_temporary, special_kind
from common.bounded_read import read_bounded
from common.disk_full import DiskFull, is_disk_full
from common.errors import UserError
from common.file_records import FileRecord, changed_files, record_files, tree_files

__all__ = ["MARKER", "InputPath", "OutputClaim", "OutputKind", "check_output_dir", "check_output_file",
           "claim_output_dir", "entry_names", "holds_only", "json_object", "marked_files", "marker_problem",
           "new_output_dir", "read_marker", "refuse_links", "staged_directory", "write_output_file"]

MARKER = ".unmask-output.json"
# The hidden siblings of a replacement: the new directory being written, and the old one for
# the instant between the two renames.
_SIBLING = re.compile(r"^\.(?P<name>.+)\.unmask-(?P<role>new|old)-(?P<pid>\d+)$")
# Entries a refusal names before "and N more".
SHOWN_ENTRIES = 3
# The most ``json_object`` reads: a marker, a config.json, an MLflow record are kilobytes (a
# marker records a few hundred bytes per file of its output).
MAX_RECORD_BYTES = 64 << 20
# The write check's file (``_probe``): hidden, with the pid of the process that made it.
_PROBE = re.compile(r"^\.unmask-write-check-(?P<pid>\d+)-")


def _never(path: Path) -> bool:
    return False


def _no_copy(path: Path) -> list[str] | None:
    return None


@dataclass(frozen=True)
class OutputKind:
    """One kind of output directory."""

    name: str        # recorded in the marker: "export", "prep", "run", ...
    noun: str        # what the messages call it, article included: "an unmask export"
    whole: bool      # True: written in a sibling and renamed (new_output_dir); False: filled
                     # in place and resumed (claim_output_dir)
    # Recognizes a directory of this kind that carries no marker yet because another writer
    # came first (Ray Train's records in a run directory, a report's MLflow record).
    unmarked: Callable[[Path], bool] = field(default=_never, compare=False)
    # Top-level files that other steps of unmask write into a whole output after it appeared
    # (a report's MLflow record): not compared with the marker, and carried into a replacement.
    carried: frozenset[str] = frozenset()
    # Recognizes an output of this kind that has lost its marker (an earlier unmask's, or a copy
    # without it), which is refused all the same: the files beside it (relative paths), or None
    # when the directory does not hold one. It lets a refusal say what the directory is.
    unmarked_copy: Callable[[Path], list[str] | None] = field(default=_no_copy, compare=False)


@dataclass(frozen=True)
class InputPath:
    """A path the command reads, which its output must keep clear of."""

    path: str | Path
    what: str                      # for the message: "--input", "the checkpoints it exports"
    may_lie_inside: bool = False   # an input the output may hold (`unmask run`'s RUN/data)


# ------------------------------------------------------------------ reading a directory
def entry_names(directory: Path) -> set[str]:
    """The names in ``directory`` but the marker and our own temporary files."""
    return {entry.name for entry in directory.iterdir() if entry.name != MARKER and not is_temporary(entry.name)}


def json_object(path: Path) -> dict | None:
    """The JSON object in the file ``path``; None if absent, unreadable, larger than
    ``MAX_RECORD_BYTES`` or not an object."""
    try:
        record = json.loads(read_bounded(path, MAX_RECORD_BYTES, "a JSON record").decode("utf-8"))
    except (OSError, ValueError, UserError):
        return None
    return record if isinstance(record, dict) else None


def read_marker(directory: Path) -> dict | None:
    """The marker of ``directory`` (module docstring), or None when it has none."""
    return json_object(directory / MARKER)


def marker_problem(directory: Path) -> str | None:
    """Why the marker of ``directory`` cannot be read, naming it (not JSON, not a record of an
    output's kind); None when there is none, or it reads (``read_marker``)."""
    path = directory / MARKER
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
        return f"{path} cannot be read as JSON ({err})"
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return f"{path} is not the record of an unmask output (no kind in it)"
    return None


def marked_files(directory: Path) -> dict[str, FileRecord] | None:
    """The files the marker of a whole output records (``{relative path: record}``), or None
    when it records none (no marker, or one an earlier unmask wrote)."""
    files = (read_marker(directory) or {}).get("files")
    return files if isinstance(files, dict) else None


def _present_files(directory: Path, skip: Sequence[str] = ()) -> list[str]:
    """Every file under ``directory`` at any depth (relative paths), but the marker, ``skip``
    (top-level names) and our own temporary files."""
    return [name for name in tree_files(directory, skip=(MARKER, *skip)) if not is_temporary(Path(name).name)]


def holds_only(directory: Path, allowed: Callable[[str], bool]) -> bool:
    """Whether every file under ``directory``, at any depth (relative path, with ``/``), is
    one ``allowed`` accepts: what an ``unmarked`` test asks of a whole tree."""
    return all(allowed(name) for name in _present_files(directory))


def _write_marker(directory: Path, kind: OutputKind, files: dict[str, FileRecord] | None = None) -> None:
    record: dict = {"kind": kind.name, "what": kind.noun}
    if files is not None:
        record["files"] = files
    atomic_write_bytes(directory / MARKER, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())


def _listed(directory: Path, names: Sequence[str]) -> str:
    shown = [f"{name}/" if (directory / name).is_dir() else name for name in sorted(names)[:SHOWN_ENTRIES]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


# ------------------------------------------------------------------ the checks
def _refuse_files_on_the_way(target: Path, flag: str) -> None:
    blocker = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = _special(blocker) or "a file"
        where = f"is {what}" if blocker == target else f"lies below {blocker}, which is {what}"
        raise UserError(f"{flag} {target}: {where}, not a directory; choose a directory (it is created if missing)")


def _absolute(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def _refuse_inputs(target: Path, flag: str, inputs: Sequence[InputPath]) -> None:
    here = _absolute(target)
    for read in inputs:
        if "://" in str(read.path):  # on another filesystem: nothing of ours can overlap it
            continue
        there = _absolute(read.path)
        if here == there:
            raise UserError(f"{flag} {target}: is {read.what} ({read.path}), which the command reads; "
                            f"choose another {flag}")
        if there.is_relative_to(here) and not read.may_lie_inside:
            raise UserError(f"{flag} {target}: contains {read.what} ({read.path}), which the command reads; "
                            f"choose a {flag} outside it")
        if here.is_relative_to(there):
            raise UserError(f"{flag} {target}: lies inside {read.what} ({read.path}), which the command reads; "
                            f"choose a {flag} outside it")


def _in_the_way(directory: Path, kind: OutputKind, flag: str) -> str | None:
    """Why ``directory`` cannot take ``kind``'s output, with the fix; None when it can."""
    names, unreadable = entry_names(directory), marker_problem(directory)
    if unreadable is not None:
        return (f"{unreadable}, so the directory is not known to hold {kind.noun}; move it away, or choose a new "
                f"or empty directory for {flag}")
    marker = read_marker(directory)
    if marker is None:
        if not names or kind.unmarked(directory):
            return None
        beside = kind.unmarked_copy(directory)
        if beside is not None:
            others = f"; beside it, {_listed(directory, beside)}, which is not part of one" if beside else ""
            return (f"holds {kind.noun} without its {MARKER} (written by an earlier unmask, or copied without that "
                    f"file), which is not replaced{others}; move it away, or choose a new or empty directory for "
                    f"{flag}")
        return (f"is not {kind.noun}: it holds {_listed(directory, list(names))}; choose a new or empty "
                f"directory for {flag}")
    if marker["kind"] != kind.name:
        what = marker.get("what")
        what = what if isinstance(what, str) and what != kind.noun else f"an output of kind {marker['kind']!r}"
        return f"holds {what} (its {MARKER} says so), not {kind.noun}; choose a new or empty directory for {flag}"
    return _not_ours(directory, kind, flag) if kind.whole else None


def _not_ours(directory: Path, kind: OutputKind, flag: str) -> str | None:
    """What in the whole output ``directory`` its replacement would delete that the command
    did not write (rule 3), with the fix; None when it holds only its recorded files."""
    records = marked_files(directory)
    if records is None:
        return (f"holds {kind.noun} written by an earlier unmask (its {MARKER} records no files), which this unmask does "
                f"not replace; move it away, or choose another {flag}")
    present = _present_files(directory, skip=tuple(kind.carried))
    foreign = sorted(set(present) - set(records))
    if foreign:
        return (f"holds {_listed(directory, foreign)} beside {kind.noun}, and replacing the directory would "
                f"delete them; move them out, or choose another {flag}")
    changed = changed_files(directory, {name: records[name] for name in present}, trust_times=True)
    if changed:
        name, how = next(iter(changed.items()))
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        return (f"{name} {how} since {kind.noun} was written{more}, and replacing the directory would delete "
                f"it; move it out, or choose another {flag}")
    return None


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def _clear_dead_probes(directory: Path) -> None:
    """The write checks that processes killed in the middle of one left in ``directory``."""
    for entry in directory.iterdir():
        match = _PROBE.match(entry.name)
        if match is not None and int(match["pid"]) != os.getpid() and not _alive(int(match["pid"])):
            entry.unlink(missing_ok=True)


def _probe(directory: Path, target: Path, flag: str) -> None:
    """Write and remove a file in ``directory``: permissions, read-only mounts, full quotas.
    The file goes whatever stops the check; one a killed process left, the next check clears."""
    try:
        handle, probe = tempfile.mkstemp(prefix=f".unmask-write-check-{os.getpid()}-", dir=directory)
    except OSError as err:
        raise UserError(f"{flag} {target}: cannot write there ({err.strerror or err}); choose a directory "
                        f"you can write to, or fix its permissions") from None
    try:
        os.close(handle)
    finally:
        Path(probe).unlink(missing_ok=True)
    _clear_dead_probes(directory)


def check_output_dir(path: str | Path, kind: OutputKind, flag: str, inputs: Sequence[InputPath] = ()) -> Path:
    """Check, before any work and without creating anything, that ``kind``'s output can go to
    ``path`` (given with ``flag``): rules 1 and 2 of the module docstring. Returns the Path;
    a one-line UserError naming the flag, the path and the fix otherwise."""
    target = Path(path)
    _refuse_files_on_the_way(target, flag)
    _refuse_inputs(target, flag, inputs)
    if kind.whole and target.is_symlink():
        raise UserError(f"{flag} {path}: is a symbolic link, and {kind.noun} replaces its directory whole (the "
                        f"link, not what it points to); give the directory itself, {target.resolve()}")
    if target.is_dir():
        problem = _in_the_way(target, kind, flag)
        if problem is not None:
            raise UserError(f"{flag} {path}: {problem}")
    # The new directory of a whole output goes beside the target; a claim writes inside it.
    _probe(_nearest_existing(target.parent if kind.whole else target), target, flag)
    return target


# ------------------------------------------------------------------ outputs that grow in place
def _make_dirs(directory: Path) -> tuple[Path, ...]:
    """Create ``directory`` and its missing parents; the ones created, outermost first."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()][::-1]
    for path in missing:
        path.mkdir(exist_ok=True)  # another rank of the job may create it at the same time
    return tuple(missing)


def _remove_empty(directories: Sequence[Path]) -> None:
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except OSError:
            return  # not empty: it, and the ones around it, hold something


def _holds_files(directory: Path, besides: set[str] = frozenset()) -> bool:
    """Whether ``directory`` holds a file but its marker, outside the top-level entries ``besides``."""
    return any(p.name != MARKER and not p.is_dir() and p.relative_to(directory).parts[0] not in besides
               for p in directory.rglob("*"))


@dataclass(frozen=True)
class OutputClaim:
    """A directory claimed for an output that grows in place (rule 4)."""

    path: Path
    made: tuple[Path, ...]   # the directories the claim created, outermost first
    marked: bool             # whether the claim wrote the marker
    fresh: bool = False      # whether the directory was new or empty when claimed

    def abandon(self, written: Sequence[str] = ()) -> None:
        """After a failure: when the directory holds no file besides the marker (nothing was
        done worth keeping), remove what the claim added: its marker and its directories.
        ``written``: top-level names of what the command wrote there that holds nothing worth
        keeping yet (an empty lock, the config it resolved), counted as nothing and removed too,
        in a directory that was new or empty when claimed (else they may be someone's)."""
        written = set(written) if self.fresh else set()
        if not self.path.is_dir() or _holds_files(self.path, besides=written):
            return
        for name in sorted(written):
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if self.marked:
            (self.path / MARKER).unlink(missing_ok=True)
            for empty in sorted((p for p in self.path.rglob("*") if p.is_dir()), reverse=True):
                empty.rmdir()
        _remove_empty(self.made)


def claim_output_dir(path: str | Path, kind: OutputKind, flag: str,
                     inputs: Sequence[InputPath] = ()) -> OutputClaim:
    """Check ``path`` (``check_output_dir``), create it and mark it as ``kind``'s (rule 4)."""
    if kind.whole:
        raise ValueError(f"{kind.name} is written whole: use new_output_dir")
    target = check_output_dir(path, kind, flag, inputs)
    fresh = not target.is_dir() or not any(target.iterdir())
    made = _make_dirs(target)
    marked = read_marker(target) is None
    if marked:
        _write_marker(target, kind)
    return OutputClaim(target, made, marked, fresh)


# ------------------------------------------------------------------ outputs that appear whole
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return pid != os.getpid()  # our own sibling is a leftover of an earlier, failed attempt


def _clear_leftovers(target: Path) -> None:
    """The siblings a killed replacement left: its new directory is removed; an old one whose
    replacement never arrived (killed between the renames) is put back."""
    if not target.parent.is_dir():
        return
    for sibling in target.parent.iterdir():
        match = _SIBLING.match(sibling.name)
        if match is None or match["name"] != target.name or _alive(int(match["pid"])):
            continue
        if match["role"] == "old" and not target.exists():
            sibling.rename(target)
        else:
            shutil.rmtree(sibling, ignore_errors=True)


def _swap_into_place(staging: Path, target: Path) -> None:
    """``staging`` in ``target``'s place: the old one moves aside, the new one in, the old
    one goes. A reader sees the old tree or the new one, never a half-written one."""
    give_default_modes(staging)  # files readable as the umask allows (safetensors writes 0600)
    old = target.with_name(f".{target.name}.unmask-old-{os.getpid()}")
    if target.exists():
        os.rename(target, old)
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield a new hidden sibling of ``target`` to write into; on success it replaces
    ``target`` whole, on failure it is removed with the parents it needed. No checks and no
    marker: for a directory inside an output the caller owns already."""
    target = Path(target)
    made = _make_dirs(target.parent)
    _clear_leftovers(target)
    staging = target.with_name(f".{target.name}.unmask-new-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        yield staging
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise


@contextmanager
def new_output_dir(path: str | Path, kind: OutputKind, flag: str,
                   inputs: Sequence[InputPath] = ()) -> Iterator[Path]:
    """Write ``kind``'s output for ``path``: check it (``check_output_dir``), yield a new
    hidden sibling to write into, then mark it with its files' records and rename it into place
    (rule 3). Whatever the block raises leaves ``path`` as it was; a full disk is one
    ``DiskFull`` line (rule 7)."""
    target = check_output_dir(path, kind, flag, inputs)
    if not kind.whole:
        raise ValueError(f"{kind.name} grows in place: use claim_output_dir")
    existed = target.exists()
    try:
        with staged_directory(target) as staging:
            yield staging
            check_output_dir(target, kind, flag)  # what may have changed there while the work ran
            for name in sorted(kind.carried):
                if (target / name).is_file() and not (staging / name).exists():
                    shutil.copy2(target / name, staging / name)
            _write_marker(staging, kind, record_files(staging, _present_files(staging)))
    except Exception as err:
        if not is_disk_full(err, target.parent, by_free_space=False):
            raise
        kept = f"the earlier one in {target} is as it was" if existed else f"{target} was not created"
        raise DiskFull(f"{flag} {target}: no space left on device while writing {kind.noun}; nothing of it was "
                       f"kept ({kept}), and what the command read is untouched: free space on that disk (or give "
                       f"another {flag}) and rerun the same command") from None


# ------------------------------------------------------------------ output files
def _mode(file: Path) -> int | None:
    """The mode of what ``file`` names, through links; None when nothing is there."""
    try:
        return file.stat().st_mode
    except OSError:  # missing, or a dangling link
        return None


def _special(file: Path) -> str | None:
    """What ``file`` is (through links) when it is a device, a FIFO or a socket; None otherwise."""
    mode = _mode(file)
    return None if mode is None else special_kind(mode)


def _written_in_place(file: Path) -> bool:
    """Whether ``file`` is a stream written where it is, never replaced (rule 5): a character
    device (``/dev/null``, a terminal) or a FIFO, directly or through links (``/dev/stdout``)."""
    mode = _mode(file)
    return mode is not None and (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode))


def check_output_file(path: str | Path, flag: str, *, inputs: Sequence[InputPath] = (),
                      ours: Callable[[Path], bool] = _never, noun: str = "an output of unmask") -> Path:
    """Check, before any work, that the file ``path`` (given with ``flag``) can be written: not
    a directory, not an input, in a directory that exists or can be created and is writable;
    an existing non-empty file only when ``ours`` recognizes it as ``noun``; a character
    device or a FIFO, written in place (rule 5); never a block device, a socket or a link."""
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    _refuse_inputs(file, flag, inputs)
    if _written_in_place(file):
        return file
    special = _special(file)
    if special is not None:
        raise UserError(f"{flag} {path}: is {special}, not a file; give a file name")
    if file.is_symlink():
        raise UserError(f"{flag} {path}: is a symbolic link (to {os.readlink(file)}); unmask replaces the file it "
                        f"writes, which would replace the link: give the file itself, {file.resolve()}, or a new "
                        f"file name")
    if file.is_file() and file.stat().st_size and not ours(file):
        raise UserError(f"{flag} {path}: exists and is not {noun}, which it would replace; give a new file "
                        f"name, or move the file away")
    try:
        _refuse_files_on_the_way(file.parent, flag)
        _probe(_nearest_existing(file.parent), file.parent, flag)
    except UserError as err:
        raise UserError(f"{flag} {path}: cannot write this file: {str(err).removeprefix(f'{flag} ')}") from None
    return file


def _write_in_place(file: Path, data: bytes) -> None:
    """Write ``data`` into the stream ``file`` as a shell's ``>`` would, never creating a file."""
    with open(os.open(file, os.O_WRONLY), "wb") as stream:
        stream.write(data)


def write_output_file(path: str | Path, data: bytes) -> None:
    """Write the file ``path`` (checked with ``check_output_file``) atomically, creating its
    directory if needed; a character device or a FIFO is written in place (rule 5). A full
    disk is one ``DiskFull`` line, and leaves the file as it was (rule 7)."""
    file = Path(path)
    existed = file.exists()
    try:
        if _written_in_place(file):
            _write_in_place(file, data)
            return
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(file, data)
    except OSError as err:
        if not is_disk_full(err, file.parent, by_free_space=False):
            raise
        kept = "it is as it was" if existed else "it was not created"
        raise DiskFull(f"{file}: no space left on device while writing it; {kept}: free space on that disk (or "
                       f"write elsewhere) and rerun the same command") from None


# ------------------------------------------------------------------ links
def refuse_links(paths: Sequence[Path], flag: str, owner: Path) -> None:
    """Refuse, before any work, a symbolic link at any of ``paths``: what the command writes
    inside the output ``owner`` (given with ``flag``) would go through the link into what it
    points to, the user's own files (rule 6)."""
    for path in paths:
        if path.is_symlink():
            raise UserError(f"{flag} {owner}: {path.relative_to(owner)} is a symbolic link (to {os.readlink(path)}), "
                            f"and this command writes its own {path.name} there; it never writes through a link: "
                            f"remove the link (or put a copy of what it points to in its place)")

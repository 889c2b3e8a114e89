"""What was written: the size and sha256 of every file of a directory tree, and the check that
the tree still holds those bytes.

An output that appears whole records its files in its marker (``common.outputs``): a later
command replaces it only while it holds nothing but those files, unchanged, at any depth, and
a reader (``pipeline.interchange.export.load_export``) finds a truncated, replaced or altered file before
loading it. A record also keeps the file's modification time: a file whose size and time
are those recorded is the file written (a rename, a ``cp -p`` keeps both), and only a file
whose time differs is hashed again to tell a copy from a change.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["FileRecord", "HASH_THREADS", "changed_files", "record_files", "resized_files", "sha256_file", "tree_files"]

# Files hashed at once (hashlib releases the GIL while it hashes).
HASH_THREADS = 4
# Bytes read per call while hashing: large enough that the call overhead vanishes.
HASH_BLOCK = 1 << 22
# One file's record: {"bytes": size, "sha256": hex digest, "mtime_ns": modification time}.
FileRecord = dict


def sha256_file(path: Path) -> str:
    """The sha256 of the file ``path``, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def tree_files(root: Path, skip: Iterable[str] = ()) -> Iterator[str]:
    """The paths, relative to ``root`` and with ``/``, of everything under it that is not a
    directory (files, links, sockets), at every depth; top-level names in ``skip`` and what
    lies below them are left out. Links to directories are listed, not followed."""
    skipped = set(skip)
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory).relative_to(root)
        if here == Path("."):
            subdirectories[:] = [name for name in subdirectories if name not in skipped]
        links = [name for name in subdirectories if os.path.islink(os.path.join(directory, name))]
        subdirectories[:] = [name for name in subdirectories if name not in links]
        for name in sorted([*files, *links]):
            if here == Path(".") and name in skipped:
                continue
            yield (here / name).as_posix()


def record_files(root: Path, names: Iterable[str]) -> dict[str, FileRecord]:
    """``{name: record}`` of the files ``names`` (relative to ``root``), hashed in parallel."""
    names = sorted(names)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(sha256_file, [root / name for name in names]))
    records = {}
    for name, digest in zip(names, digests):
        status = (root / name).stat()
        records[name] = {"bytes": status.st_size, "sha256": digest, "mtime_ns": status.st_mtime_ns}
    return records


def _resized(path: Path, record: FileRecord) -> str | None:
    """How the file ``path`` differs from ``record`` in what one ``stat`` shows, or None."""
    if path.is_symlink() or not path.is_file():
        return "is no longer a file" if path.exists() or path.is_symlink() else "is missing"
    size = path.stat().st_size
    if size == record["bytes"]:
        return None
    return f"has {size} bytes, {record['bytes']} were written (truncated or replaced)"


def _differs(path: Path, record: FileRecord, *, trust_times: bool) -> str | None:
    """How the file ``path`` differs from ``record``, or None when it holds what was written."""
    resized = _resized(path, record)
    if resized is not None:
        return resized
    if trust_times and path.stat().st_mtime_ns == record.get("mtime_ns"):
        return None
    return None if sha256_file(path) == record["sha256"] else "has other bytes than were written (sha256 differs)"


def resized_files(root: Path, records: dict[str, FileRecord]) -> dict[str, str]:
    """``{name: how it differs}`` for each recorded file under ``root`` that is missing, no
    longer a file, or of another size: the free part of ``changed_files`` (one ``stat`` each)."""
    return {name: problem for name in sorted(records) if (problem := _resized(root / name, records[name])) is not None}


def changed_files(root: Path, records: dict[str, FileRecord], *, trust_times: bool) -> dict[str, str]:
    """``{name: how it differs}`` for each recorded file under ``root`` that is missing or
    differs from its record. ``trust_times``: a file of the recorded size and modification
    time is taken as unchanged without hashing it (the cheap check before a replacement);
    otherwise every file is hashed (a reader's check of what it loads)."""
    names = sorted(records)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        problems = pool.map(lambda name: _differs(root / name, records[name], trust_times=trust_times), names)
        return {name: problem for name, problem in zip(names, problems) if problem is not None}

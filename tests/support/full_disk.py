"""A command run with a small disk of its own: a tmpfs mounted in private user and mount
namespaces (``unshare``), so that a write meets a real ENOSPC, as on a full disk, without
privileges and without touching the machine's disks. Where the kernel allows no such
namespaces, the tests that need one are skipped (``namespaces_work``).

    done = run_on_small_disk(["sample", EXPORT, "--out", str(disk / "s.jsonl")], disk, "64k", fill=True)
    done.returncode, done.stderr, done.listing   # the disk's entries after the command, hidden ones too
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli_runner import CLI_TIMEOUT_S, cli_env, unmask_command
from tests.support.paths import REPO

# What the command writes after the listing of the disk, to tell them apart in stdout.
LISTING_MARK = "----- disk -----"


def namespaces_work() -> bool:
    """Whether unprivileged user and mount namespaces can be made here."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True,
                           check=False)
    return probe.returncode == 0


@dataclass(frozen=True)
class SmallDiskRun:
    returncode: int
    stdout: str
    stderr: str
    listing: list[str]   # every entry of the disk's top directory after the command, hidden ones too


def run_on_small_disk(args: list[str], disk: Path, size: str, *, fill: bool = False,
                      timeout: float = CLI_TIMEOUT_S) -> SmallDiskRun:
    """``unmask ARGS`` with a tmpfs of ``size`` (``mount -o size=``: "64k", "4m") mounted on the
    existing directory ``disk``; ``fill``: filled up before the command starts (a file of zeros
    takes every free byte). What the command leaves on the disk is listed before it goes."""
    quoted = shlex.quote(str(disk))
    fill_it = f"dd if=/dev/zero of={quoted}/filler bs=4k 2>/dev/null; " if fill else ""
    script = (f"mount -t tmpfs -o size={size} tmpfs {quoted} && {fill_it}{shlex.join(unmask_command(args))}; "
              f"status=$?; echo {shlex.quote(LISTING_MARK)}; ls -A1 {quoted}; exit $status")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout, check=False)
    output, _, listing = done.stdout.partition(f"{LISTING_MARK}\n")
    return SmallDiskRun(done.returncode, output, done.stderr, [name for name in listing.split("\n") if name])

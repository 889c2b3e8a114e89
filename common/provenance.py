"""Where results come from: package versions and the git commit of the checkout."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["package_version", "git_commit"]

GIT_TIMEOUT_S = 10


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or "not installed"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """The commit of the unmask checkout, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"

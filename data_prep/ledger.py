"""A ledger of finished work: one small JSON file per finished item, written atomically.

Work items (tokenized units, written shards) record themselves here only after their
output is complete and renamed into place, so after a crash or a SIGKILL the ledger lists
exactly the work that need not be redone. One file per entry lets Ray workers on several
processes record concurrently without a lock.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.atomic_files import atomic_write_bytes


class Ledger:
    """Entries ``key -> JSON object`` under ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def done(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str) -> dict:
        return json.loads(self._path(key).read_text())

    def record(self, key: str, entry: dict) -> None:
        atomic_write_bytes(self._path(key), json.dumps(entry, sort_keys=True).encode())

    def keys(self, prefix: str = "") -> list[str]:
        """The recorded keys that start with `prefix`, sorted."""
        return sorted(path.stem for path in self.directory.glob(f"{prefix}*.json"))

    def forget(self, key: str) -> None:
        """Drop an entry, so that its work is done again."""
        self._path(key).unlink(missing_ok=True)

    def __len__(self) -> int:
        return sum(1 for _ in self.directory.glob("*.json"))

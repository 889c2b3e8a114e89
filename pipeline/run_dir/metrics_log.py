"""``RUN/metrics.jsonl``: every metric a run logs, one JSON object per line, rank 0 alone.

Each line is ``{"step": N, "name": value, ...}`` with exact floats, appended as the run goes.
A resumed run first forgets the records of the steps after its checkpoint (``forget_after``)
and logs them again, so the file holds each step once. A torn last line (a run killed while
writing it) counts as after every step. The manual: docs/training.md#run-directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.atomic_files import atomic_write_bytes

__all__ = ["MetricsLog"]

# The step of a line that does not parse: after every step.
_TORN = 1 << 62


class MetricsLog:
    """The metrics.jsonl at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, metrics: dict[str, float], step: int) -> None:
        """Add the record of ``metrics`` at ``step`` (raises the OSError of a failed write)."""
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": step, **metrics}) + "\n")

    def forget_after(self, step: int) -> None:
        """Drop the records of the steps after ``step`` (the resume point), atomically."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) != len(lines):
            atomic_write_bytes(self.path, "".join(kept).encode("utf-8"))

    def holds_a_step(self) -> bool:
        """Whether it records a training step: a step after the untrained validation at step 0
        (a torn line counts as one)."""
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return False
        return any(_record_step(line) >= 1 for line in lines)


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return _TORN

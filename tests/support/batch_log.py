"""Recording which sequences formed each global batch, for the resume tests: a ``BatchHook``
that appends one line per micro-batch to ``RUN/batches-rank-R.jsonl``: the step, the place
of its first sequence in the step's global batch and a digest of each of its sequences.

Run ``python -m tests.support.batch_log unmask-args...`` (or torchrun's ``-m tests.support.batch_log train
...``) to get ``unmask`` itself with the hook on every training run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LOG = "batches-rank-{rank}.jsonl"
DIGEST_CHARS = 16


def sequence_digest(sequence: torch.Tensor) -> str:
    """A digest of one sequence's token ids (as int64, the loader's dtype)."""
    return hashlib.sha256(sequence.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True)
class BatchLog:
    """Append each micro-batch's place and sequence digests to this rank's log in ``run_dir``."""

    run_dir: Path

    def __call__(self, step: int, first: int, x0: torch.Tensor) -> None:
        rank = int(os.environ.get("RANK", "0"))
        record = {"step": step, "first": first, "sequences": [sequence_digest(row) for row in x0],
                  "time_ns": time.time_ns()}
        with open(Path(self.run_dir) / LOG.format(rank=rank), "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def logged_global_batches(run_dir: Path) -> dict[int, list[str]]:
    """Step -> the digests of its global batch in order, put together from every rank's log
    (a step logged by a run and again by its resumption keeps the later records)."""
    records = [json.loads(line) for path in sorted(Path(run_dir).glob(LOG.format(rank="*")))
               for line in path.read_text(encoding="utf-8").splitlines()]
    places: dict[int, dict[int, str]] = {}
    for record in sorted(records, key=lambda r: r["time_ns"]):
        for offset, digest in enumerate(record["sequences"]):
            places.setdefault(record["step"], {})[record["first"] + offset] = digest
    return {step: [found[place] for place in sorted(found)] for step, found in sorted(places.items())}


def _run_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--run-dir") + 1])


def main(argv: list[str]) -> int:
    """``ARGS``: run ``unmask ARGS`` with every micro-batch logged."""
    from orchestration.cli import main as unmask
    from pipeline.training.hooks import TrainHooks

    return unmask(argv, hooks=TrainHooks(on_batch=BatchLog(_run_dir(argv))))


if __name__ == "__main__":
    from orchestration.cli import end_process

    end_process(main(sys.argv[1:]))

"""Stopping a training run at a known step, for the kill tests: a ``StepHook`` that stalls
a rank after step N until a stop is requested (SIGTERM) or the process is killed.

Each rank stalls once per run directory (a marker file holds its pid), so a restarted job
runs on. Run ``python -m tests.support.stall N -- unmask-args...`` to get ``unmask`` itself (or
torchrun's ``-m tests.support.stall N -- train ...``) with the hook on every training run.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MARKER = "stalled-rank-{rank}.pid"
ANNOUNCEMENT = "unmask: stalling after step"
POLL_S = 0.05


@dataclass(frozen=True)
class StallAfterStep:
    """After ``step``, write this rank's pid to ``run_dir``'s marker and wait for a stop."""

    step: int
    run_dir: Path

    def __call__(self, step: int, stop_requested: Callable[[], bool]) -> None:
        rank = int(os.environ.get("RANK", "0"))
        marker = Path(self.run_dir) / MARKER.format(rank=rank)
        if step != self.step or marker.exists():
            return
        marker.write_text(str(os.getpid()))
        print(f"{ANNOUNCEMENT} {step} (rank {rank}, pid {os.getpid()}); waiting for SIGTERM", flush=True)
        while not stop_requested():
            time.sleep(POLL_S)


def _run_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--run-dir") + 1])


def main(argv: list[str]) -> int:
    """``N -- ARGS``: run ``unmask ARGS`` with every training run stalling after step N."""
    from orchestration.cli import main as unmask
    from pipeline.training.hooks import TrainHooks

    step, args = int(argv[0]), argv[argv.index("--") + 1:]
    return unmask(args, hooks=TrainHooks(on_step=StallAfterStep(step, _run_dir(args))))


if __name__ == "__main__":
    from orchestration.cli import end_process

    end_process(main(sys.argv[1:]))

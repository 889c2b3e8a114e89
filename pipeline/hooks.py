"""The caller's code that a training loop runs on every rank (light: the command line imports
it without the training stack)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["CheckpointHook", "StepHook", "TrainHooks"]

# After each checkpoint is committed: (its directory, the step).
CheckpointHook = Callable[[Path, int], None]
# After each optimizer step, its logging and validation, before the checkpoint decision:
# (the step, a function telling whether a stop was requested by SIGTERM/SIGINT). A script
# may inspect, profile or pause there; the kill tests stall a rank there to kill it at a
# known step.
StepHook = Callable[[int, Callable[[], bool]], None]


@dataclass(frozen=True)
class TrainHooks:
    """What the loop calls besides its own work (see the two types above)."""

    on_step: StepHook | None = None
    on_checkpoint: CheckpointHook | None = None

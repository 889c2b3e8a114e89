"""The caller's code that a training loop runs on every rank (light: the command line imports
it without the training stack). The manual: docs/cluster.md#ray-train."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["BatchHook", "CheckpointHook", "FileHook", "StepHook", "TrainHooks"]

# After each checkpoint is committed: (its directory, the step).
CheckpointHook = Callable[[Path, int], None]
# After each optimizer step, its logging and validation, before the checkpoint decision:
# (the step, a function telling whether a stop was requested by SIGTERM/SIGINT). A script
# may inspect, profile or pause there; the kill tests stall a rank there to kill it at a
# known step.
StepHook = Callable[[int, Callable[[], bool]], None]
# Before each micro-batch's forward: (the step it belongs to, as on_step numbers it; the place
# of its first sequence in that step's global batch; the micro-batch [batch, seq_len] on the
# device). A script may inspect or log the data; the resume tests record which sequences
# formed each global batch.
BatchHook = Callable[[int, int, "Tensor"], None]
# In the thread writing an asynchronous checkpoint (checkpoint.asynchronous), after each of this
# rank's files: (the file, the checkpoint's step). The kill tests stall the writer there to kill
# the run in the middle of a write.
FileHook = Callable[[Path, int], None]


@dataclass(frozen=True)
class TrainHooks:
    """What the loop calls besides its own work (see the types above)."""

    on_step: StepHook | None = None
    on_checkpoint: CheckpointHook | None = None
    on_batch: BatchHook | None = None
    on_checkpoint_file: FileHook | None = None

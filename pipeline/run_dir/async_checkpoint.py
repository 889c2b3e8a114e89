"""Asynchronous checkpoints (``checkpoint.asynchronous``): the steps go on while the files are written.

A save first takes a snapshot on every rank, the only part the step waits for: DeepSpeed's state
dicts through a checkpoint engine that keeps host copies instead of writing (:class:`CapturingEngine`),
and the rank file's EMA and RNG states. A thread per rank then writes them; once every rank has
written, a thread on rank 0 commits the checkpoint exactly as a synchronous save does (file
records, ``unmask_state.json`` last, then ``latest``, then pruning), so a kill at any moment leaves
``latest`` on an intact checkpoint. :meth:`AsyncSaves.poll`, at each step boundary while a save is
in flight (one collective), moves it from writing to committing to committed on every rank together
and then calls back; :meth:`AsyncSaves.finish` waits for it (before the next save, at the end). One
save is in flight at a time. The cost is host memory: one more copy of the checkpoint's tensors.

Not DeepSpeed's decoupled engine: it commits inside the next ``engine.step()``, so the write overlaps
one step's forward and backward, not the steps until the next checkpoint; our records and ``latest``
would have to be written inside DeepSpeed's step; and it sets the process's multiprocessing start
method to spawn. The manual: docs/training.md#asynchronous-checkpoints.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from pipeline.distributed import Distributed

__all__ = ["AsyncSaves", "CapturingEngine", "Snapshot", "capture_engine_state"]

log = logging.getLogger("unmask.checkpoint")


class CapturingEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that writes nothing: each state dict it is given is kept as a
    host copy (``files``), for ``writer`` (the engine's own) to write later, in another thread."""

    def __init__(self, writer: CheckpointEngine) -> None:
        super().__init__()
        self.name, self.writer = "CapturingEngine", writer
        self.files: list[tuple[Path, Any]] = []

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        # Live tensors (parameters, optimizer moments) change at the next step: copy them now.
        self.files.append((Path(path), clone_tensors_for_torch_save(state_dict)))

    def load(self, path: str, map_location=None) -> Any:
        raise RuntimeError("CapturingEngine only saves")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.writer.is_data_parallel_writer(dp_rank)

    def preserves_storage_sharing(self) -> bool:
        return False  # save() copies every tensor itself: DeepSpeed need not clone them first


@dataclass
class Snapshot:
    """What one rank writes of a checkpoint, as host copies: (path, object) in order, and the
    engine that serializes them (DeepSpeed's own, so the files are the ones it would write)."""

    files: list[tuple[Path, Any]]
    writer: CheckpointEngine

    def write(self, on_file: Callable[[Path], None]) -> None:
        for path, state in self.files:
            self.writer.save(state, str(path))
            on_file(path)


def capture_engine_state(engine, root: Path, tag: str) -> Snapshot:
    """DeepSpeed's ``save_checkpoint(root, tag)`` on every rank, with its files kept in memory
    (its directories are made, its collectives run)."""
    writer = engine.checkpoint_engine
    capturing = CapturingEngine(writer)
    engine.checkpoint_engine = capturing
    try:
        engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = writer
    return Snapshot(capturing.files, writer)


def host_copy(state: Any) -> Any:
    """``state`` with every tensor copied to host memory (containers rebuilt, other values kept)."""
    return clone_tensors_for_torch_save(state, torch.device("cpu"))


class _Phase(Enum):
    WRITING = "writing"        # every rank writes its files
    COMMITTING = "committing"  # rank 0 records and commits


class _Work:
    """A function run in a daemon thread (a killed process leaves an uncommitted checkpoint,
    which nothing reads), with its exception kept."""

    def __init__(self, function: Callable[[], None], name: str) -> None:
        self.error: BaseException | None = None
        self._function = function
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._function()
        except BaseException as err:  # reported on the main thread by poll()
            self.error = err

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


@dataclass
class _InFlight:
    directory: Path
    step: int
    commit: Callable[[], None]
    phase: _Phase = _Phase.WRITING
    work: _Work | None = field(default=None)


class AsyncSaves:
    """The save in flight of one rank (module docstring). ``on_failure(error, directory)`` gives the
    exception every rank raises when a rank could not write or commit (it runs after rank 0 has
    removed the partial checkpoint's files); ``on_committed(directory, step)`` runs on every rank."""

    def __init__(self, dist: Distributed, on_failure: Callable[[BaseException | None, Path], BaseException],
                 on_committed: Callable[[Path, int], None]) -> None:
        self.dist, self.on_failure, self.on_committed = dist, on_failure, on_committed
        self.in_flight: _InFlight | None = None

    def start(self, directory: Path, step: int, write: Callable[[], None], commit: Callable[[], None]) -> None:
        """Write (``write``, every rank) and then commit (``commit``, rank 0) checkpoint ``step``
        in the background; call after :meth:`finish` (one save at a time)."""
        assert self.in_flight is None, "finish() the save in flight first"
        self.in_flight = _InFlight(directory, step, commit)
        self.in_flight.work = _Work(write, f"unmask-checkpoint-{step}")

    def poll(self) -> None:
        """Advance the save in flight where every rank has finished its part (one collective, the
        same number on every rank); raise on every rank where one failed."""
        flight = self.in_flight
        if flight is None:
            return
        work = flight.work
        failed, busy = self.dist.sum([float(work is not None and work.error is not None),
                                      float(work is not None and not work.done)])
        if failed:
            self.in_flight = None
            raise self.on_failure(work.error if work is not None else None, flight.directory)
        if busy:
            return
        if flight.phase is _Phase.WRITING:
            flight.phase = _Phase.COMMITTING
            flight.work = _Work(flight.commit, f"unmask-commit-{flight.step}") if self.dist.is_main else None
            return
        self.in_flight = None
        self.on_committed(flight.directory, flight.step)

    def finish(self) -> None:
        """Wait until the save in flight is committed on every rank (or raise its failure)."""
        while self.in_flight is not None:
            if self.in_flight.work is not None:
                self.in_flight.work.wait()
            self.poll()

    def abandon(self) -> None:
        """A failing run that cannot reach the other ranks: wait for this rank's own writing,
        commit nothing (the directory stays without its state file: never read, pruned later)."""
        if self.in_flight is not None and self.in_flight.work is not None:
            self.in_flight.work.wait()
        if self.in_flight is not None:
            log.warning("checkpoint %s: not committed (the run failed while it was written)",
                        self.in_flight.directory.name)
        self.in_flight = None

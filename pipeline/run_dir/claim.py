"""A run directory's life around a training: claimed, locked, given its own files, given back.

Inside ``claimed_run_dir`` rank 0 has claimed the directory as a run's (``common.outputs``:
never the data, a prep, an export or a directory of other files) and holds its lock
(``pipeline.run_dir.lock``); every rank raises rank 0's refusal. Nothing is written through a
link: a symbolic link where training writes (``RunLayout.training_writes``) is refused, and
``RUN/checkpoints`` may be a link (a bigger disk) only to a directory outside every other run,
which the log names. A training that fails before its first step leaves nothing: a directory
the claim created goes, with what the training wrote there. ``write_run_files`` writes the
resolved config and the tokenizer, so that the run directory stands on its own. The manual:
docs/training.md#run-directory.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.outputs import InputPath, OutputClaim, claim_output_dir, read_marker, refuse_links
from data_prep.shards.storage import is_remote
from data_prep.tokenizer.base import Tokenizer
from pipeline.distributed import Distributed
from pipeline.run_dir.checkpoint import latest_checkpoint
from pipeline.run_dir.layout import RUN_KIND, RunLayout, training_data
from pipeline.run_dir.lock import RunLock
from pipeline.run_dir.metrics_log import MetricsLog

__all__ = ["claimed_run_dir", "write_run_files"]

log = logging.getLogger("unmask.train")


@contextmanager
def claimed_run_dir(run_dir: str | Path, dist: Distributed, data_dir: str | Path,
                    inputs: list[InputPath]) -> Iterator[None]:
    """Hold ``run_dir`` for a training on ``data_dir`` (module docstring); ``inputs``: the
    other inputs the directory keeps clear of (an --init-from source)."""
    lock, claim = _claim(Path(run_dir), dist, data_dir, inputs)
    try:
        yield
    except BaseException:
        lock.release()
        if claim is not None and not _took_a_step(Path(run_dir)):
            claim.abandon(written=[path.name for path in RunLayout(run_dir).before_first_step()])
        raise
    lock.release()


def _claim(run_dir: Path, dist: Distributed, data_dir: str | Path,
           inputs: list[InputPath]) -> tuple[RunLock, OutputClaim | None]:
    """Rank 0 claims ``run_dir`` as a run's and takes its lock; every rank raises its refusal."""
    lock = RunLock(run_dir)
    refusal, claim = None, None
    if dist.is_main:
        try:
            data = [] if is_remote(data_dir) else [training_data(data_dir)]
            refuse_links(RunLayout(run_dir).training_writes(), "--run-dir", run_dir)
            _check_linked_checkpoints(RunLayout(run_dir))
            claim = claim_output_dir(run_dir, RUN_KIND, "--run-dir", [*data, *inputs])
            lock.acquire()
        except UserError as err:
            refusal = err
    if dist.any(refusal is not None):
        raise refusal or UserError(f"{run_dir}: rank 0 could not lock the run directory; its message says why")
    return lock, claim


def _check_linked_checkpoints(layout: RunLayout) -> None:
    """``RUN/checkpoints`` as a link: to a directory, never inside another run (whose
    checkpoints this one would prune); one outside RUN is named in the log."""
    link = layout.checkpoints
    if not link.is_symlink():
        return
    target, root = link.resolve(), layout.root.resolve()
    if not target.is_dir():
        raise UserError(f"--run-dir {layout.root}: {link.name} is a symbolic link to {os.readlink(link)}, which is not "
                        f"a directory; create it, or remove the link")
    other = next((p for p in (target, *target.parents)
                  if p != root and (read_marker(p) or {}).get("kind") == RUN_KIND.name), None)
    if other is not None:
        raise UserError(f"--run-dir {layout.root}: {link.name} is a symbolic link to {target}, inside the training "
                        f"run {other}: this run would write its checkpoints among that run's and delete the oldest "
                        f"(checkpoint.keep_last); link to a directory of this run's own")
    if not target.is_relative_to(root):
        log.warning("%s is a link to %s, outside the run directory: checkpoints are written there, and the oldest "
                    "deleted there (checkpoint.keep_last)", link, target)


def _took_a_step(run_dir: Path) -> bool:
    """Whether the run directory holds a training step's work: a checkpoint, or the records
    of a step (``MetricsLog.holds_a_step``)."""
    return latest_checkpoint(run_dir, warn=False) is not None or MetricsLog(RunLayout(run_dir).metrics).holds_a_step()


def write_run_files(run_dir: Path, config: dict, tokenizer: Tokenizer, dist: Distributed) -> None:
    """Rank 0 writes the resolved ``config`` (``Config.to_dict()``) and the tokenizer; every
    rank waits for it."""
    layout = RunLayout(run_dir)
    if dist.is_main:
        layout.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(layout.config, (json.dumps(config, indent=2) + "\n").encode())
        tokenizer.save(layout.tokenizer)
    dist.barrier()

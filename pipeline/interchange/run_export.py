"""Which export a command given a path reads: a training run means its own newest checkpoint.

``unmask eval RUN``, ``lm-eval RUN`` and ``sample RUN`` read ``RUN/export`` only while it holds
the run's latest checkpoint: its config.json's ``checkpoint_sha256`` names the checkpoint it was
exported from (``pipeline.interchange.export.checkpoint_sha256``), wherever the run was moved.
``outdated_export`` says why it does not: an older checkpoint of the run, or another model
altogether (an import or another run's export copied in). ``choose_export`` applies the rule:
the commands that report a bound export the run's newest intact checkpoint in the place of an
older one (``refresh``); the others refuse, with the fix; another model in ``RUN/export`` is
refused by every command. An export named by its own path is read as it is, unless it lies in a
run it is not from. The manual: docs/evaluation.md#which-model-is-evaluated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.outputs import json_object
from pipeline.interchange.export import (
    CONFIG_FILE,
    checkpoint_sha256,
    damaged_export,
    export_checkpoint,
    has_ema,
    read_export_spec,
    resolve_export,
    training_run_of,
    verify_export,
)
from pipeline.run_dir.checkpoint import STATE_FILE, intact_checkpoint, latest_checkpoint
from pipeline.run_dir.layout import TAG_PATTERN, RunLayout

__all__ = ["OutdatedExport", "choose_export", "outdated_export"]

log = logging.getLogger("unmask.export")


@dataclass(frozen=True)
class OutdatedExport:
    """Why ``RUN/export`` does not hold the run's latest checkpoint."""

    reason: str   # "runs/x/export holds step 12, and the run's latest checkpoint is step 14"
    own: bool     # exported from the run (an older checkpoint): exporting again puts the latest in its place


def _step(checkpoint: Path) -> int:
    return int(TAG_PATTERN.match(checkpoint.name).group(1))


def _origin(config: dict) -> str:
    """What a foreign export holds, from its config.json."""
    imported = config.get("imported_from")
    if isinstance(imported, dict):
        return f"an import of {imported.get('codebase')}'s model from {imported.get('source')}"
    checkpoint = config.get("checkpoint")
    if isinstance(checkpoint, str):
        return f"step {config.get('step')} of another run ({Path(checkpoint).parent.parent})"
    return f"a model whose {CONFIG_FILE} names no checkpoint it was exported from"


def _exported_from(config: dict, run_dir: Path) -> bool:
    """Whether the export of ``config`` was exported from a checkpoint of ``run_dir``: one of its
    checkpoints has the recorded sha256, or the recorded checkpoint lies in its checkpoints
    (one deleted since, e.g. by ``checkpoint.keep_last``)."""
    checkpoints = RunLayout(run_dir).checkpoints
    recorded, digest = config.get("checkpoint"), config.get("checkpoint_sha256")
    if isinstance(recorded, str) and Path(recorded).parent == checkpoints.resolve():
        return True
    return isinstance(digest, str) and any(checkpoint_sha256(state.parent) == digest
                                           for state in checkpoints.glob(f"step-*/{STATE_FILE}"))


def outdated_export(run_dir: Path) -> OutdatedExport | None:
    """Why the export ``RUN/export`` (which must be there) is not the run's own export of its
    latest checkpoint (``latest_checkpoint``); None when it is. A run with no checkpoint left
    takes an export of its own as its newest."""
    export_dir = RunLayout(run_dir).export
    config = json_object(export_dir / CONFIG_FILE) or {}
    own = _exported_from(config, run_dir)
    if not own:
        return OutdatedExport(f"{export_dir} holds {_origin(config)}, not a model of the run {run_dir}", own=False)
    latest = latest_checkpoint(run_dir)
    if latest is None or config.get("checkpoint_sha256") == checkpoint_sha256(latest):
        return None
    return OutdatedExport(f"{export_dir} holds step {config.get('step')}, and the run's latest checkpoint is step "
                          f"{_step(latest)}", own=True)


def _refuse_foreign(outdated: OutdatedExport, run_dir: Path) -> None:
    if not outdated.own:
        raise UserError(f"{outdated.reason}; an export inside a run is taken for the run's own (its report and "
                        f"MLflow records): move it out of {run_dir} and give its new path")


def choose_export(path: str | Path, *, refresh: bool = False) -> Path:
    """The export a command given ``path`` reads (module docstring): an export directory as it
    is, or a training run's ``RUN/export`` while it holds the run's latest checkpoint. With
    ``refresh`` a run whose export is missing or older is exported first; otherwise that is a
    UserError with the fix, as is another model inside a run."""
    path = Path(path)
    layout = RunLayout(path)
    if refresh and layout.is_training_run() and not (layout.export / CONFIG_FILE).is_file():
        return _export_newest(path, None)
    directory = resolve_export(path)
    run_dir = training_run_of(directory)
    if run_dir is None:
        return directory
    read_export_spec(directory)  # a newer format, or a field edited by hand, is named as such
    problem = verify_export(directory)  # what it holds is read from its config.json
    if problem is not None:
        raise damaged_export(problem, directory)
    outdated = outdated_export(run_dir)
    if outdated is None:
        return directory
    _refuse_foreign(outdated, run_dir)
    if directory == path:  # named by its own path: read as it is
        log.warning("%s: reading it as asked (`%s` means the run's latest)", outdated.reason, run_dir)
        return directory
    if refresh:
        return _export_newest(run_dir, outdated)
    raise UserError(f"{outdated.reason}: export the latest first (`unmask export {run_dir}`), or give {directory} to "
                    f"read the older export as it is")


def _export_newest(run_dir: Path, outdated: OutdatedExport | None) -> Path:
    """Export the run's newest intact checkpoint into ``RUN/export``: its EMA weights, or its live
    weights when it has no EMA (with a warning). An export already of that checkpoint (the latest
    is damaged) is kept."""
    checkpoint, passed_over = intact_checkpoint(run_dir)
    for reason in passed_over:
        log.warning("%s: passed over %s", run_dir, reason)
    if checkpoint is None:
        raise UserError(f"{run_dir}: no intact checkpoint to export"
                        + (f" ({'; '.join(passed_over)})" if passed_over else "; train first"))
    export_dir = RunLayout(run_dir).export
    if outdated is not None and (json_object(export_dir / CONFIG_FILE) or {}).get("checkpoint_sha256") \
            == checkpoint_sha256(checkpoint):
        return export_dir
    weights = "ema" if has_ema(checkpoint) else "model"
    if weights == "model":
        log.warning("%s: %s has no EMA; evaluating its live weights", run_dir, checkpoint.name)
    if outdated is None:
        log.info("%s has no export yet: exporting %s (%s weights)", run_dir, checkpoint.name, weights)
    else:
        log.warning("%s: exporting %s (%s weights) in its place", outdated.reason, checkpoint.name, weights)
    # Not --out: the command was not given it (`eval RUN --out X` writes its report to X).
    try:
        return export_checkpoint(run_dir, checkpoint, weights=weights, flag="the run's export (written for this command)")
    except UserError as err:
        raise UserError(f"{err}; or export it elsewhere (`unmask export {run_dir} --out DIR`) and give DIR") from None

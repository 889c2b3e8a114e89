"""Resuming on another number of ranks: a checkpoint in a form that does not depend on it.

Rank 0 converts a checkpoint written by W ranks once, inside its own directory, while the
others wait (``universal_checkpoint``):

    step-N/universal/ds/             DeepSpeed's universal checkpoint (``ds_to_universal``)
    step-N/universal/ema.pt          the EMA's whole tensors (``rank_files.whole_ema``)
    step-N/universal/conversion.json the size and sha256 of every file above, written last

It is written as ``universal.tmp`` and renamed when complete: a killed conversion is redone,
a finished one reused once its files match their records. Every rank then loads ``ds`` inside
``universal_loading`` and keeps its part of the EMA. Every torch file is read with the safe
loader, in this process. The manual: docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.file_records import sha256_file
from pipeline.run_dir.rank_files import whole_ema
from pipeline.run_dir.safe_load import deepspeed_loads_safely

__all__ = ["UNIVERSAL_DIR", "DEEPSPEED_DIR", "EMA_FILE", "universal_checkpoint", "universal_loading"]

log = logging.getLogger("unmask.checkpoint")

UNIVERSAL_DIR = "universal"
STAGING_SUFFIX = ".tmp"
DEEPSPEED_DIR = "ds"
EMA_FILE = "ema.pt"
RECORD_FILE = "conversion.json"
# ds_to_universal's own pointer to its output, written beside it; we name the folder instead.
DEEPSPEED_POINTER = "latest_universal"
# ds_to_universal's workers: one, so that every file is read here, under the safe loader.
CONVERSION_WORKERS = 1


def universal_checkpoint(directory: Path, rank_files: Sequence[Path]) -> Path:
    """``directory/universal``, the checkpoint in ``directory`` (written by one rank per file
    of ``rank_files``) in its universal form: converted now, or reused when a previous
    conversion is intact. Run by one process (rank 0) while the others wait."""
    universal = directory / UNIVERSAL_DIR
    if universal.is_dir():
        problem = _verify(universal)
        if problem is None:
            log.info("%s: reusing its conversion for another number of ranks", directory.name)
            return universal
        log.warning("%s: converting again (%s)", universal, problem)
        shutil.rmtree(universal)
    staging = directory / (UNIVERSAL_DIR + STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)  # what a killed conversion left
    started = time.perf_counter()
    _convert_deepspeed(directory, staging / DEEPSPEED_DIR)
    shadow, updates = whole_ema(rank_files)
    torch.save({"updates": updates, "shadow": shadow}, staging / EMA_FILE)
    atomic_write_bytes(staging / RECORD_FILE, json.dumps(_records(staging), indent=2, sort_keys=True).encode())
    staging.rename(universal)
    log.info("%s: converted for another number of ranks in %.1f s", directory.name, time.perf_counter() - started)
    return universal


def _convert_deepspeed(directory: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of ``directory`` into ``out``, its prints kept off the
    terminal (they are repeated in the error when it fails)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(directory), output_folder=str(out),
                              num_extract_workers=CONVERSION_WORKERS, num_merge_workers=CONVERSION_WORKERS,
                              keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # our engines record no universal-checkpoint info
    printed = io.StringIO()
    try:
        with deepspeed_loads_safely(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            ds_to_universal.main(args)
    except Exception as err:
        raise UserError(f"{directory}: DeepSpeed could not convert this checkpoint for another number of ranks "
                        f"({type(err).__name__}: {err}); resume it with the number of ranks that wrote it. "
                        f"DeepSpeed said: {printed.getvalue()[-2000:]}") from err
    (out.parent / DEEPSPEED_POINTER).unlink(missing_ok=True)


def _records(root: Path) -> dict[str, dict]:
    """``{relative path: {"bytes", "sha256"}}`` of every file under ``root``."""
    return {str(path.relative_to(root)): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
            for path in sorted(root.rglob("*")) if path.is_file() and path.name != RECORD_FILE}


def _verify(universal: Path) -> str | None:
    """Why the conversion in ``universal`` cannot be reused (a missing, truncated or altered
    file, or no record), or None."""
    record = universal / RECORD_FILE
    if not record.is_file():
        return f"{record} is missing"
    try:
        expected = json.loads(record.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        return f"{record} is corrupt ({err})"
    found = _records(universal)
    differ = sorted(set(expected) ^ set(found)) or [name for name in expected if expected[name] != found[name]]
    return f"{universal / differ[0]} differs from the one converted" if differ else None


@contextlib.contextmanager
def universal_loading(engine) -> Iterator[None]:
    """Within the block ``engine.load_checkpoint`` reads a universal checkpoint. DeepSpeed
    reads its ``checkpoint.load_universal`` setting only while loading, and the engine is
    built before the run knows which checkpoint it resumes, so the setting is switched here.
    Two slips of DeepSpeed's ZeRO-3 universal loader (0.19) are undone after it: it gives
    every param group the first group's hyperparameters (our norms would get the matrices'
    weight decay), and one ``step`` tensor to all of them, which AdamW increments in place
    once per group (each group's bias correction would run ahead). Its warning that no
    model-parallel unit was given (we have none) is kept quiet."""
    from deepspeed.utils import logger as deepspeed_logger

    optimizer = engine.optimizer.optimizer  # torch's AdamW inside DeepSpeed's ZeRO optimizer
    own = _own_hyperparameters(optimizer.param_groups)
    config, level = engine._config, deepspeed_logger.level
    config.load_universal_checkpoint = True
    deepspeed_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        config.load_universal_checkpoint = False
        deepspeed_logger.setLevel(level)
    for group, values in zip(optimizer.param_groups, own):
        group.update(values)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _own_hyperparameters(groups: list[dict]) -> list[dict]:
    """Each param group's values of the hyperparameters the groups do not share."""
    keys = [key for key in groups[0] if key != "params" and any(group.get(key) != groups[0][key] for group in groups)]
    return [{key: group[key] for key in keys} for group in groups]

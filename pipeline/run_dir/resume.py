"""Resuming a run: the checkpoint it continues from, and whether this run may continue it.

``checkpoint_to_resume`` is the newest intact checkpoint (the same on every rank), or None
for a run without any. ``check_resumable`` compares what the checkpoint recorded with what
this run is made of (both ``CheckpointMeta``) and refuses, in one line, a checkpoint of an
earlier unmask, another tokenizer, other data or another config (unless
``allow_config_change``), and a network of another shape (always: weights cannot be
reshaped). The manual: docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.errors import UserError
from model.spec import ModelSpec, build_trainable
from model.transformer import TransformerConfig
from pipeline.config import ModelSection, config_differences
from pipeline.run_dir.checkpoint import STATE_FILE, CheckpointManager, CheckpointMeta, EarlierCheckpoint

__all__ = ["NOTHING_KEPT", "check_resumable", "checkpoint_to_resume"]

# The resume point of a run started from scratch: no step's records are kept.
NOTHING_KEPT = -1


def checkpoint_to_resume(checkpoints: CheckpointManager, mode: str) -> Path | None:
    """The checkpoint a run continues from (``CheckpointManager.newest_intact``), None without
    any; ``mode`` "never" refuses a run directory that has checkpoints."""
    latest = checkpoints.latest()
    if latest is None:
        return None
    if mode == "never":
        raise UserError(f"{checkpoints.run_dir} already has checkpoints (latest {latest.name}); pass "
                        f"--resume auto to continue it or choose a new --run-dir")
    return checkpoints.newest_intact()


def check_resumable(saved: CheckpointMeta, now: CheckpointMeta, directory: Path, *, data_dir: str | Path,
                    allow_config_change: bool) -> list[str]:
    """Refuse to continue checkpoint ``directory`` (``saved``) as this run (``now``) where it
    differs (module docstring); return every config field that changed, resume-safe ones
    included, as ``config_differences`` words them."""
    missing = [f"{section}.{key}" for section, values in now.config.items() for key in values
               if key not in saved.config.get(section, {})]
    if missing:
        raise EarlierCheckpoint(f"{directory / STATE_FILE}: written by an earlier unmask (its config has no "
                                f"{missing[0]}); train again in a new --run-dir")
    if saved.tokenizer_sha256 != now.tokenizer_sha256:
        raise UserError(f"cannot resume {directory}: its tokenizer differs from {data_dir}'s")
    if saved.data_sha256 != now.data_sha256 and not allow_config_change:
        raise UserError(f"cannot resume {directory}: its data (manifest.json) differs from {data_dir}'s; pass "
                        f"--allow-config-change to continue on the new data anyway")
    differ = config_differences(saved.config, now.config)
    if differ and not allow_config_change:
        raise UserError(f"cannot resume {directory} with a different config: " + "; ".join(differ)
                        + ". Pass --allow-config-change to resume anyway.")
    mismatch = _first_tensor_mismatch(_spec(saved), _spec(now))
    if mismatch is not None:
        changed = ", ".join(d.split(":")[0] for d in differ if d.startswith("model.")) or "model"
        raise UserError(f"cannot resume {directory}: the network changed shape ({changed}): {mismatch}. "
                        f"--allow-config-change cannot reshape weights: keep the checkpoint's model section, or "
                        f"train this one in a new --run-dir")
    return config_differences(saved.config, now.config, include_resume_safe=True)


def _spec(meta: CheckpointMeta) -> ModelSpec:
    return ModelSection(**meta.config["model"]).spec(TransformerConfig(**meta.network))


def _first_tensor_mismatch(saved: ModelSpec, now: ModelSpec) -> str | None:
    """The first weight whose name or shape differs between the two specs' trained modules,
    named with both shapes; None when they agree. Built on the meta device: names and shapes
    only, nothing allocated."""
    with torch.device("meta"):
        old, new = ({name: tuple(t.shape) for name, t in build_trainable(spec, validate=False).state_dict().items()}
                    for spec in (saved, now))
    for name in [*old, *(name for name in new if name not in old)]:
        if old.get(name) != new.get(name):
            return f"{name} is {_shape(old.get(name))} in the checkpoint and {_shape(new.get(name))} in this config"
    return None


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))

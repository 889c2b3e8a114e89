"""Checkpoints: DeepSpeed's layout plus our own state, committed only when complete.

    RUN/checkpoints/step-00000100/   DeepSpeed's model and optimizer files (every rank)
        rank-00000.pt                 this rank's EMA slice and RNG states
        unmask_state.json             step, tokens, loader position, config, hashes (rank 0)
    RUN/checkpoints/latest            "step-00000100", moved after every rank finished

A process killed while writing leaves ``latest`` on the previous complete checkpoint; the
half-written directory is overwritten when that step is saved again, or pruned.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.atomic_files import atomic_write_bytes
from pipeline.distributed import Distributed
from pipeline.ema import EMA
from pipeline.errors import UserError

__all__ = ["CHECKPOINTS_DIR", "TrainState", "CheckpointManager", "STATE_FILE", "step_tag", "read_state",
           "rank_file", "resolve_checkpoint", "set_latest", "TAG_PATTERN"]

CHECKPOINTS_DIR = "checkpoints"  # in the run directory; also what marks a directory as a run
STATE_FILE = "unmask_state.json"
LATEST_FILE = "latest"
TAG_PATTERN = re.compile(r"^step-(\d{8})$")


def step_tag(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.pt"


@dataclass
class TrainState:
    """What the loop needs, beyond weights and optimizer, to continue exactly."""

    step: int = 0                  # optimizer steps taken
    tokens_seen: int = 0           # training tokens consumed, all ranks
    skipped_steps: int = 0         # steps whose gradients were not finite
    consecutive_skipped: int = 0
    loader: dict | None = None     # StreamingLoader.state_dict() (the same on every rank)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE_FILE
    if not path.is_file():
        raise UserError(f"{directory}: not a complete unmask checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def resolve_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The directory of checkpoint ``step`` of a run, or of its latest one."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if step is not None:
        directory = root / step_tag(step)
        if not (directory / STATE_FILE).is_file():
            have = sorted(int(m.group(1)) for d in root.glob("step-*") if (m := TAG_PATTERN.match(d.name))
                          and (d / STATE_FILE).is_file()) if root.is_dir() else []
            raise UserError(f"{run_dir}: no complete checkpoint at step {step}; available: {have or 'none'}")
        return directory
    latest = root / LATEST_FILE
    if not latest.is_file():
        raise UserError(f"{run_dir}: no checkpoint yet ({latest} is missing); train first")
    return root / latest.read_text().strip()


def set_latest(run_dir: Path, tag: str) -> None:
    """Point the run's ``latest`` at checkpoint ``tag`` (atomically: a reader sees old or new)."""
    atomic_write_bytes(Path(run_dir) / CHECKPOINTS_DIR / LATEST_FILE, tag.encode())


class CheckpointManager:
    """Saves and restores the engine, the EMA and the loop state of one run."""

    def __init__(self, run_dir: Path, dist: Distributed, keep_last: int) -> None:
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.dist, self.keep_last = dist, keep_last

    def latest(self) -> Path | None:
        path = self.root / LATEST_FILE
        return self.root / path.read_text().strip() if path.is_file() else None

    def save(self, engine, ema: EMA, state: TrainState, meta: dict[str, Any]) -> Path:
        """Write checkpoint ``state.step`` on every rank; commit it with ``latest``."""
        tag = step_tag(state.step)
        directory = self.root / tag
        if self.dist.is_main and directory.exists():
            shutil.rmtree(directory)  # a half-written save of this step by a killed run
        self.dist.barrier()
        engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"ema": ema.state_dict(), "rng": _rng_state()}, rank_file(directory, self.dist.rank))
        self.dist.barrier()
        if self.dist.is_main:
            payload = {**asdict(state), **meta, "world_size": self.dist.world_size}
            atomic_write_bytes(directory / STATE_FILE, json.dumps(payload, indent=2, sort_keys=True).encode())
            set_latest(self.root.parent, tag)
            self._prune()
        self.dist.barrier()
        return directory

    def load(self, engine, ema: EMA, directory: Path) -> dict[str, Any]:
        """Restore engine, EMA and RNG from ``directory``; return its unmask state."""
        saved = read_state(directory)
        if saved["world_size"] != self.dist.world_size:
            raise UserError(f"{directory} was written by {saved['world_size']} ranks, this run has "
                            f"{self.dist.world_size}: the data order and ZeRO partitions depend on the "
                            f"world size; resume with the same number of processes")
        load_path, _ = engine.load_checkpoint(str(self.root), tag=directory.name)
        if load_path is None:
            raise UserError(f"{directory}: DeepSpeed could not load this checkpoint")
        rank_state = torch.load(rank_file(directory, self.dist.rank), weights_only=False)
        ema.load_state_dict(rank_state["ema"])
        _set_rng_state(rank_state["rng"])
        return saved

    def _prune(self) -> None:
        steps = sorted(int(m.group(1)) for d in self.root.iterdir() if (m := TAG_PATTERN.match(d.name)))
        complete = [s for s in steps if (self.root / step_tag(s) / STATE_FILE).is_file()]
        keep = set(complete[-self.keep_last:])
        for step in steps:
            if step not in keep and step < max(keep):
                shutil.rmtree(self.root / step_tag(step), ignore_errors=True)

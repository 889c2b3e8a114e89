"""The rank files of a checkpoint: what each rank writes beside DeepSpeed's files.

    RUN/checkpoints/step-N/rank-00000.pt   {"ema": the rank's EMA state, "rng": its RNG states}

The EMA state is ``EMA.state_dict()`` (``pipeline.training.ema``): under ZeRO-3 each rank's
holds its flat, zero-padded slice of every parameter (``partitioned``, with the whole
``shapes``); otherwise every rank holds the whole EMA. ``whole_ema`` puts the whole float32
tensors back together from the files of all ranks, for an export or a resume on another
number of ranks. The RNG states are tensors and plain values, so the files load with the
safe loader (``pipeline.run_dir.safe_load``). The manual: docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.errors import UserError
from pipeline.run_dir.safe_load import load_torch_file

__all__ = ["rank_file", "rng_state", "set_rng_state", "full_state", "whole_ema"]


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    """Every generator the loop draws from, as tensors and plain values (loadable with
    ``weights_only``: numpy's own state would need numpy's constructors)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` recorded."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_state(states: list[dict]) -> dict[str, Tensor]:
    """Whole float32 tensors from the EMA states of all ranks (rank order); unpartitioned
    states are identical on every rank, and the first is used."""
    first = states[0]
    if not first["partitioned"]:
        return {name: t.clone() for name, t in first["shadow"].items()}
    full = {}
    for name, shape in first["shapes"].items():
        numel = int(torch.Size(shape).numel())
        flat = torch.cat([state["shadow"][name] for state in states])
        full[name] = flat[:numel].view(shape).clone()
    return full


def whole_ema(paths: Sequence[Path]) -> tuple[dict[str, Tensor], int]:
    """The whole EMA tensors and the number of updates of the rank files ``paths`` (rank
    order): the slices of all under ZeRO-3, else the first (every rank holds it whole)."""
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise UserError(f"{paths[0].parent}: EMA files missing: {missing}; the checkpoint is incomplete")
    first = load_torch_file(paths[0])["ema"]
    states = [first] + [load_torch_file(path)["ema"] for path in paths[1:]] if first["partitioned"] else [first]
    return full_state(states), first["updates"]

"""Reading torch files without running code from them.

A ``.pt`` file is a pickle, and unpickling can call any function the file names: a
checkpoint someone shared can carry ``os.system`` in a ``__reduce__``. Every torch file
unmask reads goes through ``torch.load(weights_only=True)``, whose unpickler builds only
tensors, containers and primitive types, plus the few classes listed here that our own
files and DeepSpeed's contain (inert data holders: an enum, a dataclass, a loss-scaler
record, numpy's array constructor for the RNG state of older checkpoints). A file that
asks for anything else is refused with an error naming it.

DeepSpeed loads its own files with the full unpickler (weights_only off). Inside
:func:`deepspeed_loads_safely` torch's documented switch ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
overrides that argument, so every ``torch.load`` DeepSpeed makes (the engine's checkpoint
engine, ZeRO-to-fp32, the universal-checkpoint readers) gets the same restricted unpickler.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from common.errors import UserError

__all__ = ["load_torch_file", "deepspeed_loads_safely", "find_unloadable", "UnsafeOrCorruptFile"]

FORCE_WEIGHTS_ONLY_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
# What a truncated or overwritten torch file raises while it is read.
_CORRUPTION_ERRORS = (EOFError, RuntimeError, zipfile.BadZipFile, ValueError, OSError, KeyError,
                      IndexError, TypeError, AttributeError)


_GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeOrCorruptFile(UserError):
    """A torch file that would run code, or that is truncated or corrupt."""


def _allowed_globals() -> list[Any]:
    """Classes our checkpoints and DeepSpeed's legitimately pickle (all inert records)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # numpy: the legacy MT19937 state (a uint32 array) in rank files of earlier versions.
    numpy_array = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    return [LossScaler, ZeroStageEnum, fragment_address, *numpy_array]


def load_torch_file(path: str | Path, *, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to data: raises :class:`UnsafeOrCorruptFile` naming ``path``
    when the file asks to run code or cannot be read whole."""
    path = Path(path)
    if not path.is_file():
        raise UnsafeOrCorruptFile(f"{path}: missing; the checkpoint is incomplete")
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeOrCorruptFile(_refusal(path, err)) from None
    except _CORRUPTION_ERRORS as err:
        raise UnsafeOrCorruptFile(f"{path}: truncated or corrupt ({type(err).__name__}: {_first_line(err)}); "
                                  "use an older checkpoint (`--resume auto` falls back to the newest "
                                  "intact one) or copy the file again") from None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else "no detail"


def _refusal(path: Path, err: pickle.UnpicklingError) -> str:
    named = _GLOBAL_NAME.search(str(err))  # torch names the callable it refused to look up
    if named:
        name = named.group(1)
        return (f"{path}: refused: loading it would call {name}, which a checkpoint never needs; "
                "the file may run code on your machine. Delete it, or get the checkpoint from its author again")
    return (f"{path}: refused: not a plain tensor file ({_first_line(err)}); the file may be corrupt or run "
            "code on your machine. Delete it, or get the checkpoint from its author again")


@contextmanager
def deepspeed_loads_safely() -> Iterator[None]:
    """Within the block every ``torch.load`` (DeepSpeed's too) unpickles data only."""
    previous = os.environ.get(FORCE_WEIGHTS_ONLY_ENV)
    os.environ[FORCE_WEIGHTS_ONLY_ENV] = "1"
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY_ENV, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY_ENV] = previous


def find_unloadable(directory: Path) -> UnsafeOrCorruptFile | None:
    """The error of the first torch file in ``directory`` that does not load safely, if any:
    names the culprit when a library's load failed without saying which file it read."""
    for path in sorted(Path(directory).glob("*.pt")):
        try:
            load_torch_file(path)
        except UnsafeOrCorruptFile as err:
            return err
    return None

"""Reading torch files without running code from them.

Every torch file unmask reads goes through :func:`load_torch_file`: ``torch.load`` with
``weights_only``, whose unpickler builds only tensors, containers and primitive types, plus
the few inert classes DeepSpeed's files contain (an enum, a dataclass, a loss-scaler record).
A file that asks for anything else is refused in one line naming it, as is a truncated one.
Inside :func:`deepspeed_loads_safely` every ``torch.load`` DeepSpeed makes gets the same
restricted unpickler. The manual: docs/security.md#what-it-loads.
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
    """Classes DeepSpeed's checkpoints legitimately pickle (all inert records)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


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
                                  "use an earlier checkpoint of the run (`--resume auto` falls back to "
                                  "the newest intact one) or copy the file again") from None


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

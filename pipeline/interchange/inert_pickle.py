"""Reading the tensors of a torch file that also pickles arbitrary objects, without running code.

Other codebases' checkpoints (PyTorch Lightning's ``.ckpt``) pickle hyper-parameters, tokenizers
and more beside their tensors, which ``torch.load`` either runs or refuses. This unpickler hands
the pickle machine only the callables in ``_ALLOWED`` (its own rebuilders of tensors and
parameters, ``OrderedDict``, ``set``, ``frozenset``); every other global the file names becomes
an ``InertObject`` that records what it is passed and does nothing else. A tensor is a
``TensorRef`` until ``InertArchive.tensor`` reads it from the archive's own records, checked
against their declared sizes. Only torch's zip format (``torch.save`` since torch 1.6) is read.
The manual: docs/security.md.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

from common.errors import UserError

__all__ = ["InertArchive", "InertObject", "TensorRef"]

PICKLE_RECORD = "data.pkl"
BYTE_ORDER_RECORD = "byteorder"
STORAGE_DIR = "data"
PERSISTENT_STORAGE_TAG = "storage"

# torch.save names each storage's element type by a legacy class of the torch namespace.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
# What a truncated or malformed archive raises while its pickle or records are read.
_MALFORMED = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
              AttributeError, RecursionError, zipfile.BadZipFile, OSError)


class InertObject:
    """What an unknown global of the file becomes: a record of what the pickle passed to it.

    ``origin`` is the global's dotted name (a subclass per name). Calls and ``__new__`` keep
    their arguments in ``args``/``kwargs``, ``BUILD`` keeps its state in ``state``, and list
    or dict items appended by the pickle land in ``items``/``entries``. Nothing else happens:
    the original class or function is never looked up.
    """

    origin: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        record = super().__new__(cls)
        record.args, record.kwargs = args, kwargs
        record.state, record.items, record.entries = None, [], {}
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the arguments are kept by __new__
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries[key] = value

    def __repr__(self) -> str:
        return f"<inert {self.origin}>"


@dataclass(frozen=True)
class _StorageType:
    """A storage class named by the file (``torch.FloatStorage``): only its element type."""

    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the archive, not read yet: ``InertArchive.tensor`` reads it."""

    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        raise pickle.UnpicklingError(f"malformed tensor: {what} is {value!r}")
    return value


def _rebuild_tensor(storage: Any, offset: Any, shape: Any, stride: Any, *_unused: Any) -> TensorRef:
    """``torch._utils._rebuild_tensor_v2``'s place: (requires_grad, hooks, metadata) are ignored."""
    if not isinstance(storage, _StorageRef) or type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError(f"malformed tensor: storage {storage!r} at offset {offset!r}")
    shape, stride = _ints(shape, "its shape"), _ints(stride, "its stride")
    if len(shape) != len(stride):
        raise pickle.UnpicklingError(f"malformed tensor: shape {shape} and stride {stride} differ in length")
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset - 1
    if last >= storage.numel:
        raise pickle.UnpicklingError(f"malformed tensor: reaches element {last} of a storage of {storage.numel}")
    return TensorRef(storage, offset, shape, stride)


def _rebuild_parameter(data: Any, *_unused: Any) -> Any:
    """``torch._utils._rebuild_parameter(_with_state)``'s place: a parameter is its data."""
    return data


def _rebuild_from_type(rebuild: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``'s place: ``rebuild`` came from ``find_class``, so it
    is one of ours or inert; the subclass and its Python state are dropped."""
    return rebuild(*args) if isinstance(args, tuple) else InertObject()


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("collections", "OrderedDict"): OrderedDict,
    # Pickle protocol 2 (torch.save's) spells the builtins module as Python 2 did.
    **{(module, name): kind for module in ("builtins", "__builtin__")
       for name, kind in (("set", set), ("frozenset", frozenset))},
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins: dict[tuple[str, str], type[InertObject]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        key = (module, name)
        if key not in self._stand_ins:
            self._stand_ins[key] = type(name, (InertObject,), {"origin": f"{module}.{name}"})
        return self._stand_ins[key]

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == PERSISTENT_STORAGE_TAG):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not key.isdigit() \
                or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage record {pid!r}")
        return _StorageRef(key, storage_type.dtype, numel)


class InertArchive:
    """A torch zip archive opened for inert reading; use as a context manager.

    ``root()`` is the unpickled object tree (tensors as ``TensorRef``, unknown objects as
    ``InertObject``); ``tensor(ref)`` reads one tensor. Errors are ``UserError``s naming the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as err:
            raise UserError(f"{self.path}: not a readable zip archive ({err}): truncated, or not written by "
                            "torch.save of torch >= 1.6 (load and save it again there)") from None
        try:
            self._prefix = self._find_prefix()
            self._check_byte_order()
        except UserError:
            self._zip.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._zip.close()

    def _find_prefix(self) -> str:
        pickles = [name for name in self._zip.namelist() if name.rsplit("/", 1)[-1] == PICKLE_RECORD]
        if len(pickles) != 1 or pickles[0].count("/") != 1:
            raise UserError(f"{self.path}: not a torch checkpoint (expected one DIR/{PICKLE_RECORD} record, "
                            f"found {pickles[:3]})")
        return pickles[0].split("/")[0] + "/"

    def _check_byte_order(self) -> None:
        record = self._prefix + BYTE_ORDER_RECORD
        if record in self._zip.namelist() and self._zip.read(record).strip() != b"little":
            raise UserError(f"{self.path}: written on a big-endian machine; load and save it again on a "
                            "little-endian one")

    def root(self) -> Any:
        """The unpickled contents; nothing in them has run (module docstring)."""
        try:
            return _InertUnpickler(self._zip.read(self._prefix + PICKLE_RECORD)).load()
        except _MALFORMED as err:
            raise UserError(f"{self.path}: truncated or malformed ({type(err).__name__}: {err})") from None

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """The tensor ``ref`` points at, as a contiguous copy."""
        storage = ref.storage
        record = f"{self._prefix}{STORAGE_DIR}/{storage.key}"
        try:
            data = self._zip.read(record)
        except (KeyError, *_MALFORMED) as err:
            raise UserError(f"{self.path}: storage record {record} cannot be read ({err})") from None
        itemsize = torch.empty(0, dtype=storage.dtype).element_size()
        if len(data) != storage.numel * itemsize:
            raise UserError(f"{self.path}: storage record {record} has {len(data)} bytes, its pickle declares "
                            f"{storage.numel} x {itemsize}; the file is truncated or corrupt")
        flat = torch.frombuffer(bytearray(data), dtype=storage.dtype) if data else torch.empty(0, dtype=storage.dtype)
        if math.prod(ref.shape) == 0:
            return torch.empty(ref.shape, dtype=storage.dtype)
        return torch.as_strided(flat, ref.shape, ref.stride, ref.offset).clone()

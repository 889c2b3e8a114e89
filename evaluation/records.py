"""Records: frozen dataclasses written to and read from JSON objects by their own fields and type
hints, the one mechanism behind results.json and downstream.json (``evaluation.results``).

    @dataclass(frozen=True, kw_only=True)
    class Row(Record):
        name: str
        calls: tuple[int, ...]
        note: str | Absent = ABSENT

    row.to_json(), Row.from_json(data), Row.missing(data)

A field holds a JSON value, a record, a list, tuple or ``dict[str, ...]`` of them, or a type with
``to_dict``/``from_dict``; None is written as null. The object holds the fields in their order;
a field that may hold ``ABSENT`` is left out when it does, and is the only key an object may
lack. ``from_json(r.to_json()) == r``. ``missing`` checks keys and the shape of objects and
arrays, not the types of values; a ``RecordFile`` is a whole file, read only when complete.
See docs/evaluation.md#the-results-files.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar, Union

__all__ = ["ABSENT", "Absent", "JsonObject", "Record", "RecordFile"]

JsonObject = dict[str, Any]
R = TypeVar("R", bound="Record")


class Absent(enum.Enum):
    """The type of ``ABSENT``: a key that the JSON leaves out (None is written as null)."""

    ABSENT = "absent"

    def __bool__(self) -> bool:
        return False  # "if results.training:" reads as "when there is one"

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent.ABSENT


class Record:
    """A frozen dataclass written as a JSON object: the base of every record of the results."""

    def to_json(self) -> JsonObject:
        """The JSON object of the record: its fields in order, without the ABSENT ones."""
        values = ((name, hint, getattr(self, name)) for name, hint in _fields(type(self)))
        return {name: _write(hint, value) for name, hint, value in values if value is not ABSENT}

    @classmethod
    def from_json(cls, data: JsonObject) -> Self:
        """The record that ``data`` holds; ``data`` is one that ``missing`` finds complete."""
        return _build(cls, data)

    @classmethod
    def missing(cls, data: Any, where: str = "") -> list[str]:
        """The dotted names of what ``data`` (the JSON at ``where``) lacks to be this record: the
        keys it lacks, in field order, then what its records lack; ``where`` when it is no object."""
        if not isinstance(data, dict):
            return [where]
        lacks = [_join(where, name) for name, hint in _fields(cls) if name not in data and not _may_be_absent(hint)]
        for name, hint in _fields(cls):
            if name in data:
                lacks += _lacking(hint, data[name], _join(where, name))
        return lacks


class RecordFile(Record):
    """A record that is a whole JSON file: read only when complete, written with sorted keys."""

    WHAT: ClassVar[str]   # what the file holds, as its errors name it ("results")
    REDO: ClassVar[str]   # how to write the file anew

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """The record of a whole file's object: a one-line ValueError names every key it lacks
        (``WHAT`` itself when it is no JSON object), where the schema is and how to redo it."""
        lacks = cls.missing(data) if isinstance(data, dict) else [cls.WHAT]
        if lacks:
            raise ValueError(f"{cls.WHAT} lack {', '.join(lacks)} (see {cls.__module__} for the schema); "
                             f"{cls.REDO}")
        return _build(cls, data)

    def dumps(self) -> str:
        """The text of the file: indented, keys sorted, UTF-8 as is."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> Self:
        """The record of the file at ``path``; ValueError when it is not one (OSError when it
        cannot be read)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


# ------------------------------------------------------------------ the type hints
@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((field.name, hints[field.name]) for field in fields(cls))


def _join(where: str, key: str | int) -> str:
    return f"{where}.{key}" if where else str(key)


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    return typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else None


def _may_be_absent(hint: Any) -> bool:
    return Absent in (_union_args(hint) or ())


def _value_type(hint: Any) -> tuple[Any, bool]:
    """The type a field's value has when it is neither ABSENT nor None, and whether None may be it."""
    options = _union_args(hint)
    if options is None:
        return hint, False
    present = [option for option in options if option not in (Absent, type(None))]
    if len(present) != 1:
        raise TypeError(f"a record field is one type, maybe None, maybe ABSENT: {hint}")
    return present[0], type(None) in options


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def _fixed_length(hint: Any) -> int | None:
    """The length of a tuple type of fixed length (``tuple[float, float]``: 2), else None."""
    args = typing.get_args(hint)
    return len(args) if typing.get_origin(hint) is tuple and Ellipsis not in args else None


def _items(hint: Any, value: list | tuple) -> list[tuple[Any, Any]]:
    """Each item of the list or tuple ``value`` of type ``hint``, with its type."""
    args = typing.get_args(hint)
    if _fixed_length(hint) is not None:
        return list(zip(args, value, strict=True))
    return [(args[0] if args else Any, item) for item in value]


# ------------------------------------------------------------------ writing, reading, checking
def _build(cls: type[R], data: JsonObject) -> R:
    return cls(**{name: _read(hint, data[name]) if name in data or not _may_be_absent(hint) else ABSENT
                  for name, hint in _fields(cls)})


def _write(hint: Any, value: Any) -> Any:
    kind, _ = _value_type(hint)
    origin = typing.get_origin(kind)
    if value is None:
        return None
    if _is_record(kind):
        return value.to_json()
    if hasattr(kind, "from_dict"):
        return value.to_dict()
    if origin is dict:
        return {key: _write(typing.get_args(kind)[1], item) for key, item in value.items()}
    if origin in (list, tuple):
        return [_write(item_hint, item) for item_hint, item in _items(kind, value)]
    return copy.deepcopy(value)


def _read(hint: Any, data: Any) -> Any:
    kind, _ = _value_type(hint)
    origin = typing.get_origin(kind)
    if data is None:
        return None
    if _is_record(kind):
        return _build(kind, data)
    if hasattr(kind, "from_dict"):
        return kind.from_dict(data)
    if origin is dict:
        return {key: _read(typing.get_args(kind)[1], item) for key, item in data.items()}
    if origin in (list, tuple):
        return origin(_read(item_hint, item) for item_hint, item in _items(kind, data))
    return copy.deepcopy(data)


def _lacking(hint: Any, data: Any, where: str) -> list[str]:
    """What the JSON ``data`` at ``where`` lacks to be of type ``hint``: the records in it
    checked, a dict that should be an object or a list that should be an array named whole."""
    kind, nullable = _value_type(hint)
    origin = typing.get_origin(kind)
    if data is None and nullable:
        return []
    if _is_record(kind):
        return kind.missing(data, where)
    if origin is dict:
        if not isinstance(data, dict):
            return [where]
        return [lack for key, item in data.items() for lack in _lacking(typing.get_args(kind)[1], item,
                                                                         _join(where, key))]
    if origin in (list, tuple):
        length = _fixed_length(kind)
        if not isinstance(data, list) or length not in (None, len(data)):
            return [where]
        return [lack for index, (item_hint, item) in enumerate(_items(kind, data))
                for lack in _lacking(item_hint, item, _join(where, index))]
    return []

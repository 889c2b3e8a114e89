"""The sweep file of ``unmask sweep SWEEP.yaml``: a typed ``SweepSpec``, refused in one line.

A sweep names a base training config, the prepared data, FLOP budgets, a ladder of sizes (preset
names, or widths whose depth and heads follow ``orchestration.sweep.plan``'s rule), the processes
(named groups of ``SECTION.FIELD`` overrides: any config axis) and how trials run. Every problem
is one line naming the file and the field (``budgets[1]``, ``processes.ar.model.objective``).
The manual: docs/scaling.md#the-sweep-file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.bounded_read import TooLarge, read_bounded
from common.errors import UserError
from model.transformer import PRESETS
from pipeline.config import yaml_problem

__all__ = ["Resources", "SizeSpec", "SweepSpec", "load_sweep"]

MAX_SWEEP_BYTES = 1 << 20
NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


@dataclass(frozen=True)
class SizeSpec:
    """One rung of the ladder: a preset, or a width (depth and heads derived unless given)."""

    preset: str | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None


@dataclass(frozen=True)
class Resources:
    """What one trial holds while it runs: one trial per worker."""

    cpus: float = 1.0
    gpus: float = 0.0


@dataclass(frozen=True)
class SweepSpec:
    """A whole sweep, as its file says it (paths resolved against the file's folder)."""

    source: str                                  # the file, for messages
    config: Path                                 # the base training config of every trial
    data: str | None                             # an `unmask prep --out` directory; None: config's data.path
    budgets: tuple[float, ...]                   # training FLOPs of each trial
    sizes: tuple[SizeSpec, ...]
    processes: dict[str, dict[str, Any]]         # name -> {"SECTION.FIELD": value}
    reference: str | None = None                 # the process the compute multipliers compare with
    min_steps: int = 20                          # fewer optimizer steps: the point is refused
    max_epochs: float = 1.0                      # the most passes over the prep's train split
    warmup_fraction: float = 0.1                 # of each trial's steps
    checkpoints: int = 4                         # per trial, evenly spaced: where a killed trial resumes
    eval_batches: int | None = None              # validation batches of the final bound; None: the split
    max_retries: int = 1                         # a failed trial runs again this many times
    resources: Resources = field(default_factory=Resources)


def _problem(source: str, where: str, value: Any, why: str) -> UserError:
    return UserError(f"{source}: field {where} = {value!r}: {why}")


def _read(path: Path) -> dict:
    try:
        text = read_bounded(path, MAX_SWEEP_BYTES, "a sweep file").decode("utf-8")
    except (OSError, TooLarge, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the sweep file ({err}); give a YAML file (docs/scaling.md)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a sweep file is a mapping with config, budgets, sizes and processes "
                        f"(docs/scaling.md#the-sweep-file)")
    return raw


def _number(source: str, where: str, value: Any, *, integer: bool = False, low: float = 0.0,
            strict: bool = True) -> float:
    """A finite number above ``low`` (``strict``) or at least it; YAML's "1e18" string too."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = int(value) if integer and isinstance(value, int) else float(value)
    except (TypeError, ValueError):
        raise _problem(source, where, value, "expected a number") from None
    if integer and not isinstance(value, int):
        raise _problem(source, where, value, "expected an integer")
    if not math.isfinite(number) or (number <= low if strict else number < low):
        raise _problem(source, where, value, f"must be {'>' if strict else '>='} {low:g}")
    return number


def _fraction(source: str, value: Any) -> float:
    number = _number(source, "warmup_fraction", value, strict=False)
    if number >= 1:
        raise _problem(source, "warmup_fraction", value, "must lie in [0, 1)")
    return number


def _size(source: str, where: str, value: Any) -> SizeSpec:
    if isinstance(value, str):
        if value not in PRESETS:
            raise _problem(source, where, value, f"choose a preset of {sorted(PRESETS)} or a mapping with d_model")
        return SizeSpec(preset=value)
    if not isinstance(value, dict) or "d_model" not in value:
        raise _problem(source, where, value, "expected a preset name or a mapping with d_model "
                                             "(and n_layers, n_heads if not derived)")
    unknown = sorted(set(value) - {"d_model", "n_layers", "n_heads"})
    if unknown:
        raise _problem(source, f"{where}.{unknown[0]}", value[unknown[0]], "unknown; a size has d_model, "
                                                                              "n_layers and n_heads")
    shape = {key: int(_number(source, f"{where}.{key}", value[key], integer=True))
             for key in ("d_model", "n_layers", "n_heads") if value.get(key) is not None}
    return SizeSpec(**shape)


def _processes(source: str, raw: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(raw, dict) or not raw:
        raise _problem(source, "processes", raw, "expected a mapping of names to config overrides, "
                                                 "e.g. {ar: {model.objective: autoregressive}, mdlm: {}}")
    processes = {}
    for name, overrides in raw.items():
        if not isinstance(name, str) or not name or set(name) - NAME_CHARACTERS:
            raise _problem(source, "processes", name, "a process name uses letters, digits, '-', '_' and '.'")
        overrides = overrides or {}
        if not isinstance(overrides, dict) or any(not isinstance(k, str) or "." not in k for k in overrides):
            raise _problem(source, f"processes.{name}", overrides, "expected a mapping of SECTION.FIELD "
                                                                   "to values, e.g. {model.block_size: 4}")
        processes[name] = dict(overrides)
    return processes


FIELDS = {"config", "data", "budgets", "sizes", "processes", "reference", "min_steps", "max_epochs",
          "warmup_fraction", "checkpoints", "eval_batches", "max_retries", "resources"}


def load_sweep(path: str | Path) -> SweepSpec:
    """The sweep file at ``path``, checked field by field (the points are checked by the plan)."""
    path = Path(path)
    raw, source = _read(path), str(path)
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise UserError(f"{source}: unknown field {unknown[0]}; a sweep file has {sorted(FIELDS)}")
    for required in ("config", "budgets", "sizes", "processes"):
        if raw.get(required) is None:
            raise UserError(f"{source}: field {required} is missing (docs/scaling.md#the-sweep-file)")
    for listed in ("budgets", "sizes"):
        if not isinstance(raw[listed], list) or not raw[listed]:
            raise _problem(source, listed, raw[listed], "expected a non-empty list")
    budgets = tuple(_number(source, f"budgets[{i}]", v) for i, v in enumerate(raw["budgets"]))
    if len(set(budgets)) < len(budgets):
        raise _problem(source, "budgets", raw["budgets"], "a budget appears twice")
    sizes = tuple(_size(source, f"sizes[{i}]", v) for i, v in enumerate(raw["sizes"]))
    processes = _processes(source, raw["processes"])
    reference = raw.get("reference")
    if reference is not None and reference not in processes:
        raise _problem(source, "reference", reference, f"choose one of the processes {sorted(processes)}")
    resources = raw.get("resources") or {}
    if not isinstance(resources, dict) or set(resources) - {"cpus", "gpus"}:
        raise _problem(source, "resources", resources, "expected a mapping with cpus and gpus")
    eval_batches = raw.get("eval_batches")
    return SweepSpec(
        source=source, config=Path(_relative(path, raw["config"], "config")),
        data=None if raw.get("data") is None else _relative(path, raw["data"], "data"),
        budgets=budgets, sizes=sizes, processes=processes, reference=reference,
        min_steps=int(_number(source, "min_steps", raw.get("min_steps", 20), integer=True)),
        max_epochs=_number(source, "max_epochs", raw.get("max_epochs", 1.0)),
        warmup_fraction=_fraction(source, raw.get("warmup_fraction", 0.1)),
        checkpoints=int(_number(source, "checkpoints", raw.get("checkpoints", 4), integer=True)),
        eval_batches=None if eval_batches is None else int(_number(source, "eval_batches", eval_batches,
                                                                   integer=True)),
        max_retries=int(_number(source, "max_retries", raw.get("max_retries", 1), integer=True, strict=False)),
        resources=Resources(cpus=_number(source, "resources.cpus", resources.get("cpus", 1.0)),
                            gpus=_number(source, "resources.gpus", resources.get("gpus", 0.0), strict=False)))


def _relative(sweep_file: Path, value: Any, where: str) -> str:
    """A path of the file, relative to the file's folder (a sweep file travels with its configs);
    a URI (object storage) as given."""
    if not isinstance(value, str) or not value:
        raise _problem(str(sweep_file), where, value, "expected a path")
    if "://" in value:
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else sweep_file.parent / path)

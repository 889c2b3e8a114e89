"""The user's lm-eval task YAMLs, read before lm-eval reads them (``unmask lm-eval``).

``check_task_yamls`` reads every ``*.yaml`` under the include paths, the ``--tasks`` paths and
the files they ``include:``, as YAML nodes (constructing nothing, importing nothing), and
refuses in one line naming the file, line and column: invalid YAML, a ``!function`` tag (lm-eval
would import and run the Python beside it) unless ``allow_code``, an ``include:`` that does not
exist, and a local ``dataset_kwargs.data_files`` path that matches no file. Our own tasks and
lm-eval's are installed code and are not read here. Why: docs/downstream.md#tasks-without-a-download.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from common.errors import UserError
from pipeline.config import yaml_problem

__all__ = ["FUNCTION_TAG", "check_task_yamls", "task_yaml_paths"]

FUNCTION_TAG = "!function"
YAML_SUFFIXES = (".yaml", ".yml")
# Directories lm-eval's index skips (lm_eval.tasks._yaml_loader).
IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints")
# datasets' packaged builders: their data_files are paths of this machine.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
REMOTE_MARKERS = ("://", "{{")   # a URL (hf://, s3://, https://) or a template: not a local path


def task_yaml_paths(tasks: Sequence[str]) -> list[Path]:
    """The ``--tasks`` entries that are YAML files (the others are task names)."""
    return [Path(name) for name in tasks if Path(name).suffix in YAML_SUFFIXES and Path(name).is_file()]


def check_task_yamls(include_paths: Sequence[str], task_files: Sequence[Path], *, allow_code: bool) -> None:
    """Read every YAML of ``include_paths`` and ``task_files`` (and what they include) before
    lm-eval does; a UserError for the first problem (module docstring)."""
    seen: set[Path] = set()
    for path in [*_include_path_yamls(include_paths), *task_files]:
        _check_file(Path(path), seen, allow_code)


def _include_path_yamls(include_paths: Sequence[str]) -> Iterator[Path]:
    for root in include_paths:
        yield from sorted(path for path in Path(root).glob("**/*.yaml")
                          if not any(part in IGNORED_DIRS for part in path.parts))


def _check_file(path: Path, seen: set[Path], allow_code: bool) -> None:
    path = path.resolve()
    if path in seen:
        return
    seen.add(path)
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise UserError(f"task YAML {path}{yaml_problem(err)}; fix the YAML there") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"task YAML {path}: cannot be read ({err})") from None
    for node in _nodes(root):
        if node.tag == FUNCTION_TAG and not allow_code:
            raise UserError(f"{_where(path, node)}: '{FUNCTION_TAG} {node.value}' makes lm-eval import and run "
                            f"Python from {path.parent}; rerun with --allow-code if you trust that code "
                            f"(docs/security.md)")
    if isinstance(root, yaml.MappingNode):
        for included in _includes(path, root):
            _check_file(included, seen, allow_code)
        _check_data_files(path, root)


def _nodes(node: yaml.Node | None) -> Iterator[yaml.Node]:
    """``node`` and every node below it."""
    if node is None:
        return
    yield node
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _nodes(key)
            yield from _nodes(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _nodes(item)


def _value(mapping: yaml.MappingNode, key: str) -> yaml.Node | None:
    return next((value for name, value in mapping.value
                 if isinstance(name, yaml.ScalarNode) and name.value == key), None)


def _scalars(node: yaml.Node | None) -> Iterator[yaml.ScalarNode]:
    """The plain values of a scalar, a list, or a mapping of them (a split -> files mapping)."""
    if isinstance(node, yaml.ScalarNode):
        yield node
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _scalars(item)
    elif isinstance(node, yaml.MappingNode):
        for _, value in node.value:
            yield from _scalars(value)


def _where(path: Path, node: yaml.Node) -> str:
    return f"task YAML {path} line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def _includes(path: Path, root: yaml.MappingNode) -> Iterator[Path]:
    for node in _scalars(_value(root, "include")):
        target = Path(node.value) if Path(node.value).is_absolute() else path.parent / node.value
        if not target.is_file():
            raise UserError(f"{_where(path, node)}: include {node.value!r}: {target} does not exist")
        yield target


def _check_data_files(path: Path, root: yaml.MappingNode) -> None:
    kwargs = _value(root, "dataset_kwargs")
    if not isinstance(kwargs, yaml.MappingNode):
        return
    dataset = _value(root, "dataset_path")
    name = dataset.value if isinstance(dataset, yaml.ScalarNode) else None
    base = Path(name) if name is not None and Path(name).is_dir() else (
        Path.cwd() if name in LOCAL_BUILDERS else None)
    for node in _scalars(_value(kwargs, "data_files")):
        if not isinstance(node.value, str) or any(marker in node.value for marker in REMOTE_MARKERS):
            continue
        pattern = Path(node.value).expanduser()
        if not pattern.is_absolute():
            if base is None:  # relative to a Hub dataset's files, or to a base a parent YAML names
                continue
            pattern = base / pattern
        if not glob.glob(str(pattern), recursive=True):
            raise UserError(f"{_where(path, node)}: data_files {node.value!r}: {pattern} matches no file; fix the "
                            f"path (the file is read from this machine, not from the Hugging Face Hub)")

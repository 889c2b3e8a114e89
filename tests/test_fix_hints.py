"""Every flag a message, hint or help text names exists where it says (issue 26, item 8): the
flags are collected from the source of every package and from the README's `unmask ...` spans,
and checked against the real ``unmask`` parser and the config's fields."""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from orchestration.cli import build_parser
from pipeline.config import Config
from tests.paths import REPO

PACKAGES = ("common", "model", "data_prep", "pipeline", "evaluation", "orchestration")
FLAG = re.compile(r"(?<![\w-])--([a-zA-Z][\w-]*(?:\.\w+)?)")
# A command line quoted in a message: `unmask export RUN --checkpoint 8`, up to its end.
COMMAND = re.compile(r"\bunmask((?: [a-z][a-z-]*)+)((?: [^`;\n]*)?)")
# Placeholders a message writes for config overrides in general.
OVERRIDE_PLACEHOLDERS = {"SECTION.FIELD", "section.field"}
# Flags of other programs that our messages and help texts quote, with the program.
FOREIGN = {
    "cached": "git ls-files", "others": "git ls-files", "exclude-standard": "git ls-files",
    "nproc-per-node": "torchrun", "hostfile": "deepspeed", "module": "deepspeed",
    "experiment-id": "mlflow experiments restore",
    "model": "lm_eval", "model_args": "lm_eval", "metadata": "lm_eval", "include_path": "lm_eval",
    "gen_kwargs": "lm_eval",
}
# What a formatted value of an f-string becomes: no flag starts with it, so a flag computed in
# the message (--{role}-token) is left to the table it comes from.
PLACEHOLDER = "\0"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser, by its words: ("tokenizer", "train") -> its parser."""
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, (*path, name)))
    return found


COMMANDS = _commands(build_parser())


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option.removeprefix("--") for action in parser._actions for option in action.option_strings}


ALL_OPTIONS = set().union(*map(_options, COMMANDS.values()))


CONFIG_FIELDS = {f"{section.name}.{field.name}" for section in fields(Config)
                 for field in fields(getattr(Config(), section.name))}


def _texts(tree: ast.AST):
    """The strings of a module: constants, and f-strings with each formatted value a placeholder."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside.update(id(value) for value in node.values)
            yield node.lineno, "".join(value.value if isinstance(value, ast.Constant) else PLACEHOLDER
                                       for value in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside:
            yield node.lineno, node.value


def _source_texts() -> list[tuple[str, str]]:
    texts = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            texts += [(f"{path.relative_to(REPO)}:{line}", text) for line, text in _texts(ast.parse(path.read_text()))]
    return texts


def _readme_texts() -> list[tuple[str, str]]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return [(f"README.md: `{span}`", span) for span in re.findall(r"`(unmask [^`]+)`", readme)]


def _problems(where: str, text: str) -> list[str]:
    problems = []
    for flag in FLAG.findall(text):
        if "." in flag:
            if flag not in CONFIG_FIELDS and flag not in OVERRIDE_PLACEHOLDERS:
                problems.append(f"{where}: --{flag} is no config field")
        elif flag not in ALL_OPTIONS and flag not in FOREIGN:
            problems.append(f"{where}: --{flag} is no flag of any unmask command")
    for words, rest in COMMAND.findall(text):
        words = words.split()
        rest, _, inner = rest.partition(" -- ")  # `unmask submit ... -- run ...`: a command in a command
        if inner:
            problems += _problems(where, f"unmask {inner}")
        path = next((tuple(words[:n]) for n in range(len(words), 0, -1) if tuple(words[:n]) in COMMANDS), None)
        if path is None:
            continue  # "unmask run" in prose about the command, or a command named in a sentence
        parser = COMMANDS[path]
        overrides = parser.get_default("accepts_overrides")
        for flag in FLAG.findall(" ".join(words[len(path):]) + rest):
            if flag not in _options(parser) and not ("." in flag and overrides) and flag not in FOREIGN:
                problems.append(f"{where}: `unmask {' '.join(path)}` has no --{flag}")
    return problems


@pytest.mark.parametrize("source", ["code", "README"])
def test_every_flag_a_message_names_is_parsed_by_the_real_parser(source):
    texts = _source_texts() if source == "code" else _readme_texts()
    assert len(texts) > 50
    problems = [problem for where, text in texts for problem in _problems(where, text)]
    assert problems == []


def test_the_checker_catches_a_flag_that_does_not_exist():
    assert _problems("x", "export the newest intact one with --step 8")
    assert _problems("x", "run `unmask export RUN --num-samples 2`")  # a flag of another command
    assert not _problems("x", "export it: `unmask export RUN --checkpoint 8`")

"""Every flag a message, hint or help text names exists where it says: the
flags are collected from the source of every package and from the `unmask ...` spans of README.md
and the manual (docs/), and checked against the real ``unmask`` parser and the config's fields.
Every command line of their ```bash blocks is parsed whole by that parser, as ``unmask`` would."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
from dataclasses import fields

import pytest

from orchestration.cli import build_parser
from pipeline.config import Config
from tests.support.paths import REPO

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
    "write": "python -m pipeline.config_reference",
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


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _readme_texts() -> list[tuple[str, str]]:
    """The `unmask ...` spans of README.md and of every page of the manual."""
    texts = []
    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        texts += [(f"{page.relative_to(REPO)}: `{span}`", span) for span in re.findall(r"`(unmask [^`]+)`", text)]
    return texts


BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.S | re.M)
SEPARATORS = {";", "&&", "||", "|"}
# How a command line runs unmask: the program, or the module under a launcher.
PROGRAMS = {"unmask", ".venv/bin/unmask"}
MODULE = "orchestration.cli"


def _unmask_argvs(text: str) -> list[tuple[str, list[str]]]:
    """The arguments of every unmask command in the ```bash blocks of ``text``: (the line, argv)."""
    found = []
    for block in BASH_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words, segment = shlex.split(line, comments=True), []
            for word in [*words, ";"]:
                if word not in SEPARATORS:
                    segment.append(word)
                    continue
                if segment and segment[0] in PROGRAMS:
                    found.append((line.strip(), segment[1:]))
                elif MODULE in segment:  # torchrun ... -m orchestration.cli train ...
                    found.append((line.strip(), segment[segment.index(MODULE) + 1:]))
                segment = []
    return found


def _parse_problem(argv: list[str]) -> str | None:
    """Why ``unmask ARGV`` does not parse, as ``orchestration.cli.main`` parses it, or None."""
    parser, stderr = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(argv)
    except SystemExit as stop:
        return None if stop.code == 0 and "--help" in argv else stderr.getvalue().strip().splitlines()[-1]
    if extra and not getattr(args, "accepts_overrides", False):
        return f"unrecognized arguments: {' '.join(extra)}"
    unknown = [word for word in extra if word.startswith("--") and word[2:] not in CONFIG_FIELDS]
    return f"no such config field: {' '.join(unknown)}" if unknown else None


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


@pytest.mark.parametrize("source", ["code", "manual"])
def test_every_flag_a_message_names_is_parsed_by_the_real_parser(source):
    texts = _source_texts() if source == "code" else _readme_texts()
    assert len(texts) > 50
    problems = [problem for where, text in texts for problem in _problems(where, text)]
    assert problems == []


def test_every_command_line_of_the_manual_parses():
    commands = [(page, line, argv) for page in DOC_PAGES for line, argv in _unmask_argvs(page.read_text("utf-8"))]
    assert len(commands) > 40 and {page.name for page, _, _ in commands} >= {"README.md", "sampling.md", "cluster.md"}
    problems = [f"{page.relative_to(REPO)}: {line}: {problem}" for page, line, argv in commands
                if (problem := _parse_problem(argv))]
    assert problems == []


def test_the_command_line_check_catches_what_unmask_would_refuse():
    block = "```bash\n{}\n```\n"
    [(_, argv)] = _unmask_argvs(block.format("unmask sample runs/x --num 4 --nmu 4   # a typo"))
    assert "unrecognized arguments: --nmu" in _parse_problem(argv)
    [(_, argv)] = _unmask_argvs(block.format("torchrun --nproc-per-node 2 -m orchestration.cli train --data d \\\n"
                                             "    --run-dir r --optim.learning_rate 1"))
    assert "no such config field: --optim.learning_rate" in _parse_problem(argv)
    two_commands = "unmask jobs status j ; unmask sample runs/x --num 1 --sampler best"
    [(_, first), (_, argv)] = _unmask_argvs(block.format(two_commands))
    assert _parse_problem(first) is None
    assert "invalid choice" in _parse_problem(argv)
    assert _parse_problem(["train", "--data", "d", "--run-dir", "r", "--optim.lr", "1"]) is None


def test_the_checker_catches_a_flag_that_does_not_exist():
    assert _problems("x", "export the newest intact one with --step 8")
    assert _problems("x", "run `unmask export RUN --num-samples 2`")  # a flag of another command
    assert not _problems("x", "export it: `unmask export RUN --checkpoint 8`")

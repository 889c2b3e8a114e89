"""The installed ``unmask`` console script."""

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

UNMASK = shutil.which("unmask", path=str(Path(sys.executable).parent))


def _run(*args: str) -> subprocess.CompletedProcess:
    assert UNMASK, "the unmask console script is not installed next to this Python"
    return subprocess.run([UNMASK, *args], capture_output=True, text=True, timeout=60)


def test_help_lists_the_commands():
    result = _run("--help")
    assert result.returncode == 0
    assert "usage: unmask" in result.stdout and "version" in result.stdout


def test_version_prints_the_installed_version():
    result = _run("version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"unmask {metadata.version('unmask')}"
    detailed = _run("version", "--all").stdout
    assert f"torch {metadata.version('torch')}" in detailed


@pytest.mark.parametrize("args", [["frobnicate"], ["version", "--bogus"]])
def test_unknown_commands_and_flags_fail_with_usage(args):
    result = _run(*args)
    assert result.returncode == 2 and "usage:" in result.stderr


@pytest.mark.parametrize("command", [["tokenizer", "train"], ["prep"], ["train"], ["export"], ["eval"], ["sample"],
                                     ["run"], ["submit"], ["jobs", "list"], ["jobs", "logs"]])
def test_every_command_explains_itself_with_an_example(command, capsys):
    from orchestration.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: unmask " + " ".join(command) in out
    assert "example" in out

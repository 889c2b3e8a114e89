"""The installed ``unmask`` console script."""

from importlib import metadata

import pytest

from tests.support.cli_runner import run_unmask, unmask_in_process


def test_help_lists_the_commands():
    result = run_unmask(["--help"], installed=True)
    assert result.returncode == 0
    assert "usage: unmask" in result.stdout and "version" in result.stdout


def test_version_prints_the_installed_version():
    result = run_unmask(["version"], installed=True)
    assert result.returncode == 0
    assert result.stdout.strip() == f"unmask {metadata.version('unmask')}"
    detailed = run_unmask(["version", "--all"], installed=True).stdout
    assert f"torch {metadata.version('torch')}" in detailed


@pytest.mark.parametrize("args", [["frobnicate"], ["version", "--bogus"]])
def test_unknown_commands_and_flags_fail_with_usage(args):
    result = run_unmask(args, installed=True)
    assert result.returncode == 2 and "usage:" in result.stderr


@pytest.mark.parametrize("command", [["tokenizer", "train"], ["prep"], ["train"], ["export"], ["import", "mdlm"],
                                     ["import", "bd3lm"], ["eval"], ["sample"], ["run"], ["submit"], ["jobs", "list"],
                                     ["jobs", "logs"]])
def test_every_command_explains_itself_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        unmask_in_process([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: unmask " + " ".join(command) in out
    assert "example" in out

"""One rank of a launcher's job (``torchrun``, ``deepspeed``: WORLD_SIZE > 1) ends as soon as its
command is done, with the command's status and everything it printed, and without the
interpreter's teardown: there a C++ thread of gloo or DeepSpeed that still holds a Python object
can abort a rank whose work is all written (CI saw one: "terminate called without an active
exception" after a 2-rank ZeRO-3 run's last checkpoint). An ``atexit`` handler stands for the
teardown here: it runs only when the interpreter tears down."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli_runner import REPO, cli_env

# `python -m orchestration.cli ARGS` as torchrun starts it, with a teardown to see.
SCRIPT = """\
import atexit, runpy, sys
atexit.register(lambda: print("interpreter teardown", file=sys.stderr, flush=True))
sys.argv[0] = "unmask"
runpy.run_module("orchestration.cli", run_name="__main__")
"""


def _unmask_as_rank(args: list[str], world_size: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          env=cli_env({"WORLD_SIZE": world_size, "RANK": "0"}), timeout=120)


@pytest.mark.parametrize("args,status,printed", [(["version"], 0, "unmask "),
                                                 (["train", "--config", "no-such.yaml"], 2, "no-such.yaml")])
def test_a_rank_of_a_job_ends_with_its_status_and_output_but_no_teardown(args, status, printed):
    rank = _unmask_as_rank(args, world_size="2")
    assert rank.returncode == status
    assert printed in rank.stdout + rank.stderr
    assert "interpreter teardown" not in rank.stderr


def test_a_process_alone_ends_as_any_python_program():
    alone = _unmask_as_rank(["version"], world_size="1")
    assert alone.returncode == 0 and "interpreter teardown" in alone.stderr


def test_main_returns_the_status_to_a_caller_in_the_process(monkeypatch, capsys):
    """``main`` is the command line as a library call (embedders, the tests): it returns, in a
    rank of a job too; only the entry point ends the process."""
    from orchestration.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["version"]) == 0 and capsys.readouterr().out.startswith("unmask ")

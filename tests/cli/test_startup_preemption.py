"""A SIGTERM while a training command starts up is a preemption (``orchestration.startup_preemption``):
its handler is in place before the command line imports anything heavy. What such a start
leaves behind: ``tests/pipeline/run_dir/test_claim.py``."""

from __future__ import annotations

import subprocess
import sys

from tests.support.cli_runner import cli_env
from tests.support.paths import REPO


def test_the_start_up_handler_is_in_place_before_the_cli_imports_anything_heavy():
    """The first import of ``orchestration.cli`` installs it, in the unmask command's own process,
    for a training command only (the CLI's other imports take seconds: torch)."""
    probe = ("import signal, sys; sys.argv = [{program!r}, *{args!r}]; import orchestration.startup_preemption; "
             "print(getattr(signal.getsignal(signal.SIGTERM), '__name__', 'default'), 'torch' in sys.modules)")
    for program, args, installed in (("/venv/bin/unmask", ["train", "--config", "c.yaml"], "_stop"),
                                     ("/repo/orchestration/cli.py", ["run"], "_stop"),
                                     ("/venv/bin/unmask", ["eval", "runs/x"], "default"),
                                     ("/venv/bin/pytest", ["-k", "train"], "default")):
        out = subprocess.run([sys.executable, "-c", probe.format(program=program, args=args)], cwd=REPO,
                             env=cli_env(), capture_output=True, text=True, check=True).stdout
        assert out.split() == [installed, "False"], (program, args, out)

"""Connecting to Ray (``common.ray_runtime``): a local Ray leaves the command's SIGTERM handler in
place, so that a signal during a Ray-driven command ends it in one line (``orchestration.interruption``)
rather than by Ray's own handler, which exits 15 without a word."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli_runner import REPO, cli_env

# In a process of its own, as a command is: Ray reads its auth mode once per process, and a
# pytest worker may have read it already for another test.
PROBE = """\
import signal
from common.ray_runtime import ray_session

def commands_own(signum, frame):
    raise AssertionError("not called")

signal.signal(signal.SIGTERM, commands_own)
with ray_session(num_cpus=1):
    print("kept" if signal.getsignal(signal.SIGTERM) is commands_own else "replaced")
"""


@pytest.mark.slow
def test_a_local_ray_keeps_the_command_s_sigterm_handler(tmp_path):
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=cli_env({"HOME": str(tmp_path)}))
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split()[-1] == "kept"

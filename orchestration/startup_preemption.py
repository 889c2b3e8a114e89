"""A SIGTERM while a training command starts up is a preemption (exit 75), not a failure (143).

Before the training loop takes the signal over (``pipeline.training.trainer``), while ``unmask
train`` or ``unmask run`` starts up and between the stages of ``unmask run``, SIGTERM raises
``StoppedDuringStartup`` here, which ``orchestration.cli.main`` turns into
``exit_codes.PREEMPTED``. The handler is installed when this module is imported, first of all
by ``orchestration.cli``, in the ``unmask`` command's own process running a training command;
and by ``preemptible_startup`` around the command ``main`` runs in a script or a test, which
puts the previous handler back at the end. A forked child (a DataLoader worker) dies of the
signal as before. The manual: docs/cluster.md, "Preemption and exit codes".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["StoppedDuringStartup", "TRAINING_COMMANDS", "preemptible_startup"]

TRAINING_COMMANDS = ("train", "run")
# What sys.argv[0] is when this process is the unmask command: the console script, or the
# module's file under `python -m orchestration.cli`.
_COMMAND_PROGRAMS = ("unmask", "cli.py")
# The process that installed the handler (a forked child is not it).
_INSTALLED_BY: list[int] = []


class StoppedDuringStartup(BaseException):
    """SIGTERM arrived outside the training loop: the command stops where it is (a
    BaseException, so that no ``except Exception`` swallows it)."""


def _stop(signum: int, frame: object) -> None:
    if os.getpid() not in _INSTALLED_BY:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise StoppedDuringStartup(signal.Signals(signum).name)


def _trains(argv: Sequence[str]) -> bool:
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return command in TRAINING_COMMANDS and threading.current_thread() is threading.main_thread()


def _install() -> signal.Handlers | object:
    _INSTALLED_BY[:] = [os.getpid()]
    return signal.signal(signal.SIGTERM, _stop)


@contextmanager
def preemptible_startup(argv: Sequence[str]) -> Iterator[None]:
    """Around a command: for a training command, SIGTERM raises ``StoppedDuringStartup``
    until the training loop installs its own handler, and again after it restores this one."""
    if not _trains(argv):
        yield
        return
    previous = _install()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if Path(sys.argv[0]).name in _COMMAND_PROGRAMS and _trains(sys.argv[1:]):
    _install()  # at the first import, before the seconds the CLI's other imports take

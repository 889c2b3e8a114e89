"""A SIGTERM while a training command starts up is a preemption, not a failure.

Schedulers stop a job with SIGTERM and read its exit status: 75 (``exit_codes.PREEMPTED``)
is retried, 143 (killed by the signal) counts as a failure. The training loop turns SIGTERM
into a checkpoint and 75 (``pipeline.training.trainer``); before it takes the signal over, while the
command starts up (its imports take seconds, then the data and the engine), and between the
stages of `unmask run`, SIGTERM raises ``StoppedDuringStartup`` here, which ``cli.main``
turns into 75: nothing finished is lost, and a run directory the training had just created is
given back (``pipeline.training.trainer.train``).

The handler is installed as early as the process allows: when this module is imported, first
of all by ``orchestration.cli``, if the process is the ``unmask`` command itself (the console
script, or ``python -m orchestration.cli`` under torchrun, DeepSpeed or a Ray job) running a
training command; and by ``cli.main`` around the command it runs (a script or a test calling
``main`` in its own process), which puts the previous handler back at the end. A child forked
from the process (a DataLoader worker) inherits the handler and dies of the signal as before.
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

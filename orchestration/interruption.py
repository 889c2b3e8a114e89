"""SIGTERM and SIGINT outside the training loop: one line, an exit status, nothing staged left.

The signal stops the command where it is by an exception (SIGTERM: ``Terminated``; SIGINT:
``KeyboardInterrupt``, as libraries expect), so that every clean-up on the way runs (the
staging directories and write checks of ``common.outputs``, a claim that holds nothing yet);
``orchestration.cli.main`` then prints ``stop_line`` and exits with ``exit_status``: 75 for
SIGTERM to ``train`` or ``run`` (a preemption, which schedulers retry), 143 for SIGTERM to
another command, 130 for SIGINT. The training loop takes both over while it runs
(``pipeline.training.signals``). The handlers are installed at this module's first import in
the ``unmask`` command's own process, before the seconds the CLI's other imports take (a signal
then ends the process at once, with its line), and by ``handled_signals`` around ``main``. A
forked child (a DataLoader worker) gets Python's default behavior, and Ray keeps them
(``common.ray_runtime``). The manual: docs/cluster.md#preemption-and-exit-codes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from orchestration.exit_codes import INTERRUPTED, PREEMPTED, TERMINATED

__all__ = ["SIGNALS", "TRAINING_COMMANDS", "Terminated", "command_of", "exit_status", "handled_signals", "stop_line"]

TRAINING_COMMANDS = ("train", "run")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What sys.argv[0] is when this process is the unmask command: the console script, or the
# module's file under `python -m orchestration.cli`.
_COMMAND_PROGRAMS = ("unmask", "cli.py")
# The process that installed the handlers (a forked child is not it), and whether its command
# has started (before: the CLI's imports are still running).
_INSTALLED_BY: list[int] = []
_STARTED: list[bool] = [False]


class Terminated(BaseException):
    """SIGTERM arrived outside the training loop: the command stops where it is (a
    BaseException, so that no ``except Exception`` swallows it)."""


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand of ``unmask ARGV`` ("train", "export", ...), or None."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def exit_status(command: str | None, signum: int) -> int:
    """The exit status of ``command`` stopped by ``signum`` (module docstring)."""
    if signum == signal.SIGTERM and command in TRAINING_COMMANDS:
        return PREEMPTED
    return INTERRUPTED if signum == signal.SIGINT else TERMINATED


def stop_line(command: str | None, signum: int, *, started: bool = True) -> str:
    """The one line of ``command`` stopped by ``signum``: what was kept, and what to do."""
    name = signal.Signals(signum).name
    if not started:
        return f"unmask {command or ''}: stopped by {name} while starting (nothing was done yet); rerun the command"
    if signum == signal.SIGTERM and command in TRAINING_COMMANDS:
        return (f"unmask: stopped by {name} outside the training loop (starting up, or between stages); rerun the "
                f"same command to go on: finished work is kept")
    return (f"unmask {command}: stopped by {name}; what it was writing is removed and finished work is kept: rerun "
            f"the same command to go on")


def _stop(signum: int, frame: object) -> None:
    if os.getpid() not in _INSTALLED_BY:  # a forked child (a DataLoader worker): as Python does by default
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _STARTED[0]:  # the CLI's imports: nothing to clean up, nothing to unwind through
        command = command_of(sys.argv[1:])
        print(stop_line(command, signum, started=False), file=sys.stderr, flush=True)
        os._exit(exit_status(command, signum))
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signal.Signals(signum).name)


def _install() -> dict[int, object]:
    """Install ``_stop`` for both signals, but for one the process was started to ignore (a
    shell's background job ignores SIGINT, and Python leaves it so); the handlers it replaced."""
    _INSTALLED_BY[:] = [os.getpid()]
    return {signum: signal.signal(signum, _stop) for signum in SIGNALS
            if signal.getsignal(signum) is not signal.SIG_IGN}


@contextmanager
def handled_signals() -> Iterator[None]:
    """Around a command of ``unmask``: SIGTERM raises ``Terminated`` and SIGINT
    ``KeyboardInterrupt`` wherever the command is (outside the training loop, which takes
    them over and gives them back); the previous handlers are put back at the end. Only the
    main thread may install handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _install()
    _STARTED[0] = True
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if Path(sys.argv[0]).name in _COMMAND_PROGRAMS and threading.current_thread() is threading.main_thread():
    _install()  # at the first import, before the seconds the CLI's other imports take

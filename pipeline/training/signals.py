"""SIGTERM and SIGINT during training: a request to stop at the next step boundary.

``StopSignals`` turns both into a flag (``requested``) that the loop checks after each step;
it then checkpoints and returns (the command exits 75). A second SIGINT interrupts at once
(the user insists). Only the main thread may install handlers: in another thread (Ray Train
runs the loop in a worker thread and handles preemption itself) nothing is installed. The
manual: docs/cluster.md#preemption-and-exit-codes.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["StopSignals"]


class StopSignals:
    """The handlers of SIGTERM and SIGINT until ``restore`` puts the previous ones back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)

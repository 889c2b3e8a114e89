"""SIGTERM and SIGINT during training: a request to stop at the next step boundary.

``StopSignals`` turns both into a flag (``requested``) that the loop checks after each step;
it then checkpoints and returns (the command exits 75). The signal also ends any wait for
data at once (``common.stop_request``: a storage retry raises ``StopRequested``, which the
trainer takes as the same request); the request stays set after the loop, so that reads
still retrying in other threads end too. A second SIGINT interrupts at once (the user
insists). Only the main thread may install handlers: in another thread (Ray Train runs the
loop in a worker thread and handles preemption itself) nothing is installed. The manual:
docs/cluster.md#preemption-and-exit-codes.
"""

from __future__ import annotations

import signal
import threading

from common import stop_request

__all__ = ["StopSignals"]


class StopSignals:
    """The handlers of SIGTERM and SIGINT until ``restore`` puts the previous ones back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            stop_request.reset()
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True
        stop_request.request()

    def restore(self) -> None:
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            # The stop request stays: reads still retrying in other threads end too, not 10 min later.

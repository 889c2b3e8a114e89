"""A request to stop that ends every wait: a signal handler sets it, and a wait that could
last (a storage retry's backoff) ends at once when it is set, raising ``StopRequested``.

What a caller relies on: ``request()`` (the training loop's handler of SIGTERM and SIGINT,
``pipeline.training.signals``) wakes every ``wait`` on the event of this process, and of
the DataLoader workers it starts after the first ``event()`` call (the event is a
multiprocessing one; a worker is handed it with the objects it reads through, such as
``data_prep.shards.storage.ShardStore``). ``StopRequested`` is a BaseException, so that no
``except Exception`` on the way takes it for a failure. A scheduler's grace period after
SIGTERM is about 30 s: a retry that waited its whole budget would be killed with the work
since the last checkpoint. The manual: docs/cluster.md#preemption-and-exit-codes.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Event

__all__ = ["StopRequested", "event", "request", "reset", "wait"]

_EVENT: list[Event] = []  # this process's event, made at the first call that needs it


class StopRequested(BaseException):
    """A wait ended because the process was asked to stop; ``str()`` says what it waited for."""


def event() -> Event:
    """This process's stop event (made once; shared with the processes started afterwards)."""
    if not _EVENT:
        _EVENT.append(multiprocessing.get_context().Event())
    return _EVENT[0]


def request() -> None:
    """Ask every wait on this process's event to end."""
    event().set()


def reset() -> None:
    """No stop requested: a new training loop starts with waits that wait."""
    event().clear()


def wait(seconds: float, what: str, stop: Event | None = None) -> None:
    """Sleep ``seconds``, unless a stop is or gets requested on ``stop`` (default: this
    process's event): then raise ``StopRequested`` naming ``what`` was waited for."""
    if (stop or event()).wait(seconds):
        raise StopRequested(what)

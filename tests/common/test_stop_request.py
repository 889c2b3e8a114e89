"""``common.stop_request``: a wait that a stop request ends at once, in this process and in
one it starts; a cleared request lets waits wait again."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from common import stop_request
from common.stop_request import StopRequested


@pytest.fixture(autouse=True)
def no_stop_requested():
    stop_request.reset()
    yield
    stop_request.reset()


def test_a_wait_sleeps_unless_a_stop_is_requested_then_ends_at_once_naming_what_it_waited_for():
    stop_request.wait(0.01, "the store")  # nothing requested: it returns
    threading.Timer(0.05, stop_request.request).start()
    with pytest.raises(StopRequested, match="^the store$"):
        stop_request.wait(600, "the store")  # ended by the request, not by the 600 s
    with pytest.raises(StopRequested):
        stop_request.wait(600, "again")  # the request stays until reset
    stop_request.reset()
    stop_request.wait(0.01, "the store")


def test_it_is_no_failure_to_an_except_exception():
    assert not issubclass(StopRequested, Exception)


def _wait_in_child(event, results) -> None:
    try:
        stop_request.wait(600, "the child's read", event)
    except StopRequested as stop:
        results.put(str(stop))


def test_a_request_in_this_process_ends_a_wait_in_a_process_it_started():
    context = multiprocessing.get_context()
    results = context.Queue()
    child = context.Process(target=_wait_in_child, args=(stop_request.event(), results))
    child.start()
    stop_request.request()
    assert results.get(timeout=60) == "the child's read"
    child.join(timeout=60)
    assert child.exitcode == 0

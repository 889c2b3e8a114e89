"""Connecting to Ray (``common.ray_runtime``): a local Ray leaves the command's SIGTERM handler in
place, so that a signal during a Ray-driven command ends it in one line (``orchestration.interruption``)
rather than by Ray's own handler, which exits 15 without a word."""

from __future__ import annotations

import signal

import pytest

from common.ray_runtime import ray_session


@pytest.mark.slow
def test_a_local_ray_keeps_the_command_s_sigterm_handler():
    def commands_own(signum, frame):  # pragma: no cover - never called: only its identity matters
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, commands_own)
    try:
        with ray_session(num_cpus=1):
            assert signal.getsignal(signal.SIGTERM) is commands_own
    finally:
        signal.signal(signal.SIGTERM, previous)

"""The bytes torch allocates on CPU while a function runs, from the profiler's memory events
(``torch.profiler`` with ``profile_memory``: every allocation and free of torch's CPU
allocator, in order), for tests that hold memory estimates against what torch really holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

__all__ = ["Allocations", "allocations_of"]


@dataclass(frozen=True)
class Allocations:
    peak: int   # the most bytes allocated at once during the call, above what was allocated before it
    live: int   # bytes allocated during the call and still held after it


def allocations_of(function: Callable[[], object]) -> Allocations:
    """Run ``function`` under the profiler and add up its CPU allocations and frees in order.
    Tensors made before the call and freed during it are not counted (the profiler never saw
    them allocated): make what the measure should include inside ``function``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    events = sorted((event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return Allocations(peak, live)

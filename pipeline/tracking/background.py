"""Tracking that never blocks a training step: records go to MLflow from a background thread.

``BackgroundTracker.log_metrics`` only puts a step's metrics on a bounded queue
(``MAX_QUEUED``: a long outage drops the oldest, with a warning; metrics.jsonl keeps them all).
A sender thread delivers the queue in order, the metrics of consecutive steps in one request
at most every ``SEND_EVERY_S``; when the server does not answer it says so once, retries with
growing pauses (``RETRY_PAUSES_S``) and delivers what was queued, with the times it was
measured, when the server is back. ``close`` waits at most ``CLOSE_WAIT_S``, then names the
steps MLflow did not receive. ``skip``: the (key, step) pairs a resumed run's MLflow run
already holds, not sent again. The manual: docs/mlflow.md#when-the-server-is-down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.tracking.tracker import Tracker

if TYPE_CHECKING:  # MLflow is imported where it is used (pipeline.tracking.tracker says why)
    from mlflow.entities import Metric

__all__ = ["BackgroundTracker", "MAX_QUEUED", "CLOSE_WAIT_S", "FAILED_CLOSE_WAIT_S"]

log = logging.getLogger("unmask.tracking")

MAX_QUEUED = 100_000           # records (a step's metrics, a set of tags, the final status)
CLOSE_WAIT_S = 30.0            # at the end of a run, for a server that is down
FAILED_CLOSE_WAIT_S = 5.0      # when the run failed: its error should not wait long behind MLflow's
RETRY_PAUSES_S = (1.0, 2.0, 5.0, 10.0, 30.0)   # between deliveries while the server is down
SEND_EVERY_S = 1.0             # metrics wait this long to share a request with the next steps'
MS_PER_SECOND = 1000


@dataclass
class _Record:
    """One step's metrics (``step`` set), a set of tags, or the run's final status."""

    metrics: list[Metric] = field(default_factory=list)
    step: int | None = None
    tags: dict[str, str] | None = None
    status: str | None = None


@dataclass
class _Outage:
    failures: int = 0
    dropped_steps: list[int] = field(default_factory=list)


def _one_line(err: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of the error at the root of ``err``'s chain: MLflow wraps the
    database's or the network's error, whose own message spans a dozen lines."""
    while (cause := err.__cause__ or err.__context__) is not None:
        err = cause
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:limit]


class BackgroundTracker:
    """Delivers a :class:`Tracker`'s records from a thread, in order, across outages."""

    def __init__(self, tracker: Tracker, *, skip: dict[str, set[int]] | None = None,
                 metrics_file: str = "metrics.jsonl") -> None:
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        self.tracker = tracker
        self.run_id, self.tracking_uri = tracker.run_id, tracker.tracking_uri
        self.skip = skip or {}
        self.metrics_file = metrics_file
        self._queue: deque[_Record] = deque()
        self._ready = threading.Condition()
        self._closing = False
        self._stopped = False       # close() gave up on the server: the thread ends
        self._outage = _Outage()
        self._last_send = 0.0
        self._queued_metrics = 0    # metric points in the queue
        self._batch_limit = MAX_METRICS_PER_BATCH   # metric points one request may carry
        self._thread = threading.Thread(target=self._deliver, name="unmask-mlflow", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop's side
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one step's metrics (never blocks, never raises)."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * MS_PER_SECOND)
        kept = [Metric(key, float(value), timestamp, step) for key, value in metrics.items()
                if step not in self.skip.get(key, ())]
        if kept:
            self._put(_Record(metrics=kept, step=step))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put(_Record(tags=dict(tags)))

    def close(self, status: str, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Queue the run's final status, wait up to ``wait_s`` for delivery; True when MLflow
        received everything. Otherwise a warning names what it did not receive."""
        self._put(_Record(status=status))
        deadline = time.monotonic() + wait_s
        with self._ready:
            self._closing = True
            self._ready.notify_all()
            while self._queue and time.monotonic() < deadline:
                self._ready.wait(timeout=max(0.0, deadline - time.monotonic()))
            undelivered = list(self._queue)
            self._stopped = True
            self._ready.notify_all()
        if undelivered or self._outage.dropped_steps:
            self._warn_undelivered(undelivered)
        return not undelivered and not self._outage.dropped_steps

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _put(self, record: _Record) -> None:
        with self._ready:
            if len(self._queue) >= MAX_QUEUED:
                dropped = self._queue.popleft()
                self._queued_metrics -= len(dropped.metrics)
                if dropped.step is not None:
                    if not self._outage.dropped_steps:
                        log.warning("MLflow at %s: %d records queued during the outage; dropping the oldest "
                                    "(they stay in %s)", self.tracking_uri, MAX_QUEUED, self.metrics_file)
                    self._outage.dropped_steps.append(dropped.step)
            self._queue.append(record)
            self._queued_metrics += len(record.metrics)
            self._ready.notify_all()

    def _warn_undelivered(self, undelivered: list[_Record]) -> None:
        steps = sorted({r.step for r in undelivered if r.step is not None} | set(self._outage.dropped_steps))
        missed = [f"steps {steps[0]}..{steps[-1]} ({len(steps)} steps)"] if steps else []
        if any(r.status is not None for r in undelivered):
            missed.append("the run's final status")
        log.warning("MLflow at %s did not receive %s; every metric is in %s (run %s)", self.tracking_uri,
                    " and ".join(missed), self.metrics_file, self.run_id)

    # ------------------------------------------------------------------ the sender thread
    def _deliver(self) -> None:
        while True:
            with self._ready:
                while not self._closing and (not self._queue or self._should_wait()):
                    self._ready.wait(timeout=self._wait_time())
                if self._stopped or not self._queue:
                    return
                batch = self._next_batch()
            self._last_send = time.monotonic()
            if self._send(batch):
                sent = {id(record) for record in batch}
                with self._ready:  # by identity: a full queue may have dropped some of them meanwhile
                    while self._queue and id(self._queue[0]) in sent:
                        self._queued_metrics -= len(self._queue.popleft().metrics)
                    self._ready.notify_all()
            else:
                self._pause()

    def _should_wait(self) -> bool:
        """Metrics that do not fill a request yet wait for their send time (lock held)."""
        return (self._queue[0].step is not None and self._queued_metrics < self._batch_limit
                and self._wait_time() > 0)

    def _wait_time(self) -> float | None:
        if not self._queue:
            return None
        return max(0.0, self._last_send + SEND_EVERY_S - time.monotonic())

    def _next_batch(self) -> list[_Record]:
        """The head of the queue: a run of metrics records that fits one request, or one
        other record (called with the lock held)."""
        head = self._queue[0]
        if head.step is None:
            return [head]
        batch, size = [], 0
        for record in self._queue:
            if record.step is None or size + len(record.metrics) > self._batch_limit:
                break
            batch.append(record)
            size += len(record.metrics)
        return batch or [head]

    def _send(self, batch: list[_Record]) -> bool:
        try:
            head = batch[0]
            if head.status is not None:
                self.tracker.finish(head.status)
            elif head.tags is not None:
                self.tracker.set_tags(head.tags)
            else:
                self.tracker.log_metric_points([m for record in batch for m in record.metrics])
        except Exception as err:  # the server's problem, never the loop's
            if self._outage.failures == 0:
                log.warning("MLflow at %s failed to take the records (%s); training continues, metrics "
                            "are queued and kept in %s", self.tracking_uri, _one_line(err), self.metrics_file)
            self._outage.failures += 1
            return False
        if self._outage.failures:
            log.info("MLflow at %s takes records again; delivering the %d queued", self.tracking_uri,
                     len(self._queue))
            self._outage.failures = 0
        return True

    def _pause(self) -> None:
        """Wait before the next try; new records do not cut it short (they would turn an
        outage into a retry per step), the end of the run does."""
        start = time.monotonic()
        pause = RETRY_PAUSES_S[min(self._outage.failures, len(RETRY_PAUSES_S)) - 1]
        with self._ready:
            while not self._stopped:
                limit = min(pause, RETRY_PAUSES_S[0]) if self._closing else pause
                remaining = start + limit - time.monotonic()
                if remaining <= 0:
                    return
                self._ready.wait(timeout=remaining)

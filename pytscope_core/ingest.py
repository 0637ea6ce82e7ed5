"""Rank 0's ingest thread: what each gather brought is written and diagnosed off the training thread.

Whatever rank 0 does on its training thread after a gather, every other rank waits for at the next gradient
all-reduce. So the training thread only hands the gather over, through a bounded queue, and goes on; this
thread writes the rows, runs the cross-rank checks and the live diagnosis. When the queue is full (the thread
is INGEST_QUEUE gathers behind, e.g. diagnoses slower than the interval), the training thread records that
gather itself (rows, counts and replica checks are never skipped) and its diagnosis is skipped. An error on
the thread is raised on the training thread at the next hand-over, where the scope's usual handling disables
it. At the end, `close` drains the queue before the summary reads the run. A single-process run has nobody
waiting for rank 0, so it ingests in line (`threaded=False`), as before.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .live import LiveDiagnosis

INGEST_QUEUE = 2
"""Gathers waiting for the thread before a diagnosis is skipped: one being diagnosed, one more queued."""
DRAIN_POLL_S = 0.01
CLOSE_WAIT_S = 60.0
"""At the end, how long to wait for queued gathers (one diagnosis of 16,384 ranks takes about a second)."""


@dataclass(frozen=True)
class Gathered:
    """One gather as rank 0 received it, with what rank 0 learnt since the last one."""

    headers: np.ndarray
    rows: np.ndarray
    gather: int
    step: int
    final: bool
    scalars: list[dict[str, Any]]
    learnt: dict[str, Any] | None


class BackgroundIngest:
    """Feeds `LiveDiagnosis` from a daemon thread; the hand-over never blocks the training thread."""

    def __init__(self, live: LiveDiagnosis, threaded: bool = True) -> None:
        self.live = live
        self.threaded = threaded
        self.ingest_ms: list[float] = []  # on the thread, per gather: rows, checks and (when due) diagnosis
        self.handoff_ms: list[float] = []  # on the training thread, per gather: the hand-over
        self.skipped = 0  # gathers recorded on the training thread, without a diagnosis (queue full)
        self._queue: queue.Queue[Gathered | None] = queue.Queue(maxsize=INGEST_QUEUE)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pytscope-ingest", daemon=True)
        if threaded:
            self._thread.start()

    def submit(self, item: Gathered) -> None:
        """Hand a gather over (training thread). Raises what went wrong on the thread since the last call,
        except at the final gather: that one is still written, and `close` leaves the error to the caller."""
        if not item.final:
            self.raise_error()
        t0 = time.perf_counter()
        if not self.threaded:
            self._ingest(item)
            self.handoff_ms.append((time.perf_counter() - t0) * 1e3)
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.skipped += 1
            self._record(item)
        self.handoff_ms.append((time.perf_counter() - t0) * 1e3)

    def drain(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Wait until every gather handed over is written (and diagnosed); False on timeout. Polls without
        taking the queue's lock: a SIGTERM handler may call this while its own thread holds that lock."""
        polls = max(1, round(timeout_s / DRAIN_POLL_S))  # counted, not timed: user code may mock the clocks
        for _ in range(polls):
            if not self._queue.unfinished_tasks or not self._thread.is_alive():
                break
            time.sleep(DRAIN_POLL_S)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Drain, then end the thread. Idempotent; False when the queue could not be drained in time."""
        drained = self.drain(timeout_s)
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                return False
            self._thread.join(timeout_s)
        return drained

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"live diagnosis failed: {type(error).__name__}: {error}") from error

    def _record(self, item: Gathered) -> None:
        self.live.record(
            item.headers, item.rows, item.gather, item.step, item.final, item.scalars, item.learnt
        )

    def _ingest(self, item: Gathered) -> None:
        t0 = time.perf_counter()
        self._record(item)
        if not item.final:
            self.live.diagnose_if_due(item.step)
        self.ingest_ms.append((time.perf_counter() - t0) * 1e3)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._ingest(item)
            except Exception as exc:  # raised on the training thread at the next hand-over
                self._error = exc
            finally:
                self._queue.task_done()

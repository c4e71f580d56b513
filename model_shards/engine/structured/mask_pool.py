"""Rank 0's mask threads: token masks computed off the step loop, each job with a deadline.

:class:`MaskPool` runs jobs (a matcher's next mask, or a new matcher's first) in daemon
threads; ``xgrammar`` releases the GIL while it fills a mask, so the step loop runs on.
A job cannot be interrupted: one past its deadline (:meth:`MaskPool.overdue`) is given up
by its caller, and its thread is replaced (:meth:`MaskPool.replace`), up to
``max_threads`` in all, so ``threads`` keep serving the other jobs; a replaced thread ends
once its job returns. Daemon threads: a job still running never holds up the process's exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

#: Threads filling masks, and the most there may be while overdue jobs still run.
MASK_THREADS = 4
MAX_MASK_THREADS = 16


@dataclass(eq=False)
class MaskJob:
    """One job: its result (or exception) in ``future``; times from ``time.monotonic()``."""

    fn: Callable[[], Any]
    deadline_s: float  # from the moment a thread starts it
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    replaced: bool = False  # its thread was replaced: it ends after this job
    future: Future[Any] = field(default_factory=Future)

    def overdue(self, now: float) -> bool:
        started = self.started_at
        return not self.future.done() and started is not None and now - started > self.deadline_s


class MaskPool:
    """Daemon threads running :class:`MaskJob` values in submission order."""

    def __init__(self, threads: int = MASK_THREADS, max_threads: int = MAX_MASK_THREADS) -> None:
        self._queue: queue.SimpleQueue[MaskJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = threads
        self._max_threads = max_threads
        self._live = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any], deadline_s: float) -> MaskJob:
        """Queue ``fn`` (started lazily: the first jobs start the threads)."""
        job = MaskJob(fn, deadline_s)
        with self._lock:
            if self._live < self._threads and not self._closed:
                self._start_thread()
        self._queue.put(job)
        return job

    def replace(self, job: MaskJob) -> None:
        """``job`` is given up: another thread takes over its thread's share (within
        ``max_threads``); its own thread ends once ``job`` returns."""
        with self._lock:
            if job.replaced or job.future.done() or self._closed:
                return
            job.replaced = True
            if self._live < self._max_threads:
                self._start_thread()

    def close(self) -> None:
        """Stop every idle thread; jobs still queued are dropped."""
        with self._lock:
            self._closed = True
            live = self._live
        for _ in range(live):
            self._queue.put(None)

    def _start_thread(self) -> None:
        self._live += 1
        threading.Thread(target=self._work, name="grammar-mask", daemon=True).start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job.started_at = time.monotonic()
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:  # the caller reads it from the future
                job.future.set_exception(exc)
            with self._lock:
                if job.replaced:
                    self._live -= 1
                    return
        with self._lock:
            self._live -= 1

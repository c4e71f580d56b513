"""Run one load point: dispatch requests by the load shape, stop at the bounds.

A dispatcher walks the request indices in order. For a paced point it sleeps until
each seeded arrival time; with a concurrency cap it then waits for a free slot; and
then it starts the request as its own task. The point ends when ``num_requests``
have been sent and answered, or at the ``duration_s`` deadline, whichever comes
first: at the deadline, requests still in flight are cancelled and recorded as
``cancelled``, and unsent ones are not recorded at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from deploy.loadtest_lib.arrivals import arrival_offsets
from deploy.loadtest_lib.client import Target, stream_request
from deploy.loadtest_lib.config import LoadPoint
from deploy.loadtest_lib.progress import ProgressBar
from deploy.loadtest_lib.records import CANCELLED, PENDING, RequestRecord
from deploy.loadtest_lib.workload import RequestSpec

REFRESH_S = 0.25


@dataclass(frozen=True, slots=True)
class Bounds:
    """Stop after ``num_requests`` sent or ``duration_s`` seconds (``None``: no such bound);
    ``timeout_s`` caps every single request."""

    num_requests: int | None
    duration_s: float | None
    timeout_s: float


async def _refresh(progress: ProgressBar) -> None:
    """Keep the bar's clock moving while no request finishes."""
    while True:
        await asyncio.sleep(REFRESH_S)
        progress.draw()


class _Pacer:
    """When a point may send its next request: at its seeded arrival time (a paced point),
    then once a slot is free (a concurrency cap)."""

    def __init__(self, point: LoadPoint, seed: int) -> None:
        self.slots = asyncio.Semaphore(point.concurrency) if point.concurrency is not None else None
        self.arrivals: Iterator[float] | None = None
        if point.request_rate is not None:
            self.arrivals = arrival_offsets(point.request_rate, point.burstiness, seed)
        self.t0 = time.perf_counter()  # the point's start: arrival times count from here

    async def wait_for_turn(self) -> None:
        if self.arrivals is not None:
            delay = self.t0 + next(self.arrivals) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        if self.slots is not None:
            await self.slots.acquire()
        else:
            await asyncio.sleep(0)  # let started requests run between sends

    def release(self) -> None:
        """A request is over: its slot is free again."""
        if self.slots is not None:
            self.slots.release()


async def run_point(
    client: httpx.AsyncClient,
    target: Target,
    specs: Sequence[RequestSpec],
    point: LoadPoint,
    bounds: Bounds,
    seed: int,
    progress: ProgressBar | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run ``point`` and return every sent request's record (in send order) and the wall
    time in seconds. Request ``i`` uses ``specs[i % len(specs)]``. Never raises for a
    failed request; every request is sent at most once."""
    if not specs:
        raise ValueError("no requests to send")
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    pacer = _Pacer(point, seed)

    async def one(record: RequestRecord, spec: RequestSpec) -> None:
        try:
            await stream_request(client, target, spec, record, bounds.timeout_s, pacer.t0)
        finally:
            pacer.release()
        if progress is not None:
            progress.finish(record)

    async def dispatch() -> None:
        indices = (
            range(bounds.num_requests) if bounds.num_requests is not None else itertools.count()
        )
        for i in indices:
            await pacer.wait_for_turn()
            spec = specs[i % len(specs)]
            record = RequestRecord(index=i, output_len=spec.output_len)
            record.prompt_tokens = spec.prompt_tokens
            records.append(record)
            tasks.add(asyncio.create_task(one(record, spec)))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + bounds.duration_s if bounds.duration_s is not None else None
    refresher = asyncio.create_task(_refresh(progress)) if progress is not None else None
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await dispatch()
                if tasks:
                    await asyncio.wait(tasks)
    finally:
        elapsed = time.perf_counter() - pacer.t0
        await _stop(tasks, refresher)
    for record in records:
        if record.status == PENDING:
            record.status = CANCELLED
    return records, elapsed


async def _stop(tasks: set[asyncio.Task[None]], refresher: asyncio.Task[None] | None) -> None:
    """Cancel the requests still in flight, and the progress refresher; wait until they end."""
    pending = [task for task in tasks if not task.done()]
    if refresher is not None:
        pending.append(refresher)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)

"""Graceful-shutdown state shared by the front door and the CLI.

The front door counts each request in :class:`Lifecycle` until its last byte is sent. While
draining it answers new requests (``/health`` included, ``/metrics`` excepted) with a 503 and
lets those in flight finish; the CLI stops uvicorn once :meth:`Lifecycle.wait_idle` returns.
"""

from __future__ import annotations

import asyncio
import contextlib


class Lifecycle:
    """In-flight count and the draining flag of one app (create inside the event loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; false if ``timeout_s`` passed first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.in_flight == 0

"""Draining: the state a graceful shutdown needs, shared by the front door and the CLI.

:class:`Lifecycle` counts HTTP requests in flight (the front door enters and
leaves it around the app, so a streamed response counts until its last byte)
and knows whether the server is draining. While draining, the front door
answers every new request except ``/metrics`` with a 503 and ``/health`` is
503 too; requests already in flight run on. :meth:`Lifecycle.wait_idle`
returns once none is left (or after its timeout), and the CLI then stops
uvicorn.
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

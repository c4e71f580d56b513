"""uvicorn that drains on the first SIGINT/SIGTERM instead of closing at once.

First signal: the :class:`~server.http.lifecycle.Lifecycle` starts draining (new
requests 503, ``/health`` 503), the requests in flight run for up to
``shutdown_timeout_s``, then uvicorn's own graceful exit begins. A second
signal exits at once (uvicorn's ``force_exit``). The signals are not re-raised
afterwards: leaving :meth:`serve` is a normal stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from server.http.lifecycle import Lifecycle

logger = logging.getLogger("shardserve")


class DrainingServer(uvicorn.Server):
    """A :class:`uvicorn.Server` whose exit waits for in-flight requests (module docs)."""

    def __init__(
        self, config: uvicorn.Config, lifecycle: Lifecycle, shutdown_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self.lifecycle.start_draining()
        logger.info(
            "%s: draining %d request(s) in flight for up to %g s (--shutdown-timeout)",
            signal.Signals(sig).name,
            self.lifecycle.in_flight,
            self.shutdown_timeout_s,
        )
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        if not await self.lifecycle.wait_idle(self.shutdown_timeout_s):
            logger.warning(
                "%d request(s) still in flight after %g s; stopping anyway",
                self.lifecycle.in_flight,
                self.shutdown_timeout_s,
            )
        self.should_exit = True

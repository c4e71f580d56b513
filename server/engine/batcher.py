"""Frontend batching: requests arriving close together travel in one ``SubmitBatch``.

The first request into an empty batcher opens a window of ``window_s``
seconds; everything submitted until it closes (or until ``max_batch_size``
requests are waiting) is handed to ``send`` as one list, in arrival order.
A window of 0 still groups requests submitted in the same event-loop tick.

Idle fast path: when ``idle()`` (given by the owner: nothing of this client is on the
engine and no other request is on its way through the frontend) is true as a request
opens a batch, nothing would share the engine's next step with it anyway, so the
batch is sent on the next event-loop tick instead of after the window (requests of
the same tick, e.g. a request's ``n`` choices, still travel together). Under load, or
in a burst of arrivals, the window batches as before.
A request cancelled while still waiting is dropped here and never reaches the
engine. Runs on the event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from model_shards.messages import GenerateRequest


class Batcher:
    """Collect :class:`GenerateRequest` values and flush them to ``send`` in batches."""

    def __init__(
        self,
        send: Callable[[list[GenerateRequest]], None],
        window_s: float = 0.002,
        max_batch_size: int = 256,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """``idle``: whether the engine has nothing of ours (see the module docstring);
        ``None``: never idle, always wait for the window."""
        if window_s < 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window_s}")
        if max_batch_size < 1:
            raise ValueError(f"max batch size must be >= 1, got {max_batch_size}")
        self._send = send
        self._window_s = window_s
        self._max_batch_size = max_batch_size
        self._idle = idle
        self._pending: list[GenerateRequest] = []
        self._timer: asyncio.Handle | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request``; flush now if the batch is full, on the next tick if the engine
        is idle, else when the window closes."""
        self._pending.append(request)
        if len(self._pending) >= self._max_batch_size:
            self.flush()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            if self._idle is not None and self._idle():
                self._timer = loop.call_soon(self.flush)
            else:
                self._timer = loop.call_later(self._window_s, self.flush)

    def cancel(self, request_id: str) -> bool:
        """Drop a request not yet sent; return whether it was still waiting here."""
        before = len(self._pending)
        self._pending = [r for r in self._pending if r.request_id != request_id]
        return len(self._pending) != before

    def flush(self) -> None:
        """Send everything waiting as one batch (no-op when empty)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            batch, self._pending = self._pending, []
            self._send(batch)

    def close(self) -> None:
        """Drop waiting requests and the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending = []

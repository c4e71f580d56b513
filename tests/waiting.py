"""Wait on a condition, never on the clock alone.

:func:`wait_until` (blocking) and :func:`async_wait_until` (for a test running on
the event loop the code under test runs on) check ``predicate`` every
``interval`` seconds until it holds, and fail with an ``AssertionError`` naming
``what`` was awaited once ``timeout`` seconds have passed: fast on an idle
machine, patient on a loaded one, and a clear message when the thing never
happens. ``explain`` (blocking form), when given, adds its text to that message
(a server's log). The async form also takes a predicate returning an awaitable
(e.g. one that reads ``/metrics`` over HTTP).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


class _Deadline:
    """``timeout`` seconds from now; :meth:`check` raises once they have passed."""

    def __init__(
        self, timeout: float, what: str, explain: Callable[[], object] | None = None
    ) -> None:
        self._end = time.monotonic() + timeout
        self._message = f"timed out after {timeout:g} s waiting for {what}"
        self._explain = explain

    def check(self) -> None:
        if time.monotonic() >= self._end:
            detail = "" if self._explain is None else f"\n{self._explain()}"
            raise AssertionError(self._message + detail)


def wait_until(
    predicate: Callable[[], bool],
    what: str,
    timeout: float = 10.0,
    interval: float = 0.01,
    explain: Callable[[], object] | None = None,
) -> None:
    """Block until ``predicate()`` is true; ``AssertionError`` naming ``what`` after ``timeout``."""
    deadline = _Deadline(timeout, what, explain)
    while not predicate():
        deadline.check()
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout: float = 10.0,
    interval: float = 0.01,
) -> None:
    """:func:`wait_until` yielding to the event loop between checks (``predicate`` may be async)."""
    deadline = _Deadline(timeout, what)
    while not await _holds(predicate):
        deadline.check()
        await asyncio.sleep(interval)


async def _holds(predicate: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = predicate()
    return bool(await result) if inspect.isawaitable(result) else bool(result)

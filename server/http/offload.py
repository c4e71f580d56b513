"""Work proportional to a request's size, run off the event loop.

:class:`Offload` runs a function in a small pool of threads and awaits it, in the caller's
context (its context variables, e.g. the TTFT trace, are seen by the function). The event
loop keeps serving every other route meanwhile, provided the function either releases the
GIL for its long parts (the tokenizer: :meth:`server.text.tokenizer.Tokenizer.encode`) or is
Python code (the interpreter switches threads every few milliseconds). A caller cancelled
while its function runs gets nothing; the function still runs to its end.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: Requests prepared at once; more wait their turn (the event loop is free meanwhile).
PREPARE_THREADS = 4


class Offload:
    """A bounded pool of threads that route handlers await work in."""

    def __init__(self, threads: int = PREPARE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prepare")

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` in a pool thread; its exception is raised here."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Start no more work (what runs finishes in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

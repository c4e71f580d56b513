"""Load shedding and deadlines for generating and embedding requests.

* :class:`Admission` counts the requests and tokens outstanding in the
  frontend (admitted, response not yet finished). A request that would take
  either count past its limit (``--max-queued-requests``,
  ``--max-queued-tokens``; ``None``: no limit) is refused with a 429 carrying
  ``Retry-After``; nothing reaches the engine. A generation's tokens are its
  prompt tokens plus ``max_tokens``, per choice; an embedding request's are
  its input tokens (after truncation). A single request larger than
  the token limit is still admitted when nothing else is outstanding (so it
  cannot be refused for ever). A chat request with images or videos is admitted
  before they are fetched, as one request of no tokens; :meth:`Ticket.grow` then adds
  its tokens (the same 429 when that takes the token count past its limit).
* :func:`with_deadline` ends a response's frames at a deadline
  (``--request-timeout``): before the first frame it raises the 504
  :class:`~server.http.errors.APIError` (the client gets a proper status); after
  it, an SSE error event then ``data: [DONE]``. Either way the frames
  generator is closed, which aborts the request on the engine. A JSON
  response (a generation without ``stream``, or embeddings) past its
  deadline is cancelled, which aborts it too, and is answered with the same
  504 (:func:`timeout_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator

from server.api.serving import sse
from server.http.errors import APIError

#: ``Retry-After`` (seconds) sent with a 429.
RETRY_AFTER_S = 1


class Ticket:
    """One admitted request's share of the counts; :meth:`release` (idempotent) returns it."""

    def __init__(self, admission: Admission, tokens: int) -> None:
        self._admission = admission
        self.tokens = tokens
        self._released = False

    def grow(self, tokens: int) -> Ticket:
        """This ticket holding ``tokens`` more; past ``--max-queued-tokens`` (with other
        requests outstanding) it is released and the 429 :class:`APIError` raised."""
        admission = self._admission
        limit = admission.max_tokens
        if limit is not None and admission.requests > 1 and admission.tokens + tokens > limit:
            self.release()
            raise _overloaded(
                f"the server has {admission.tokens} tokens outstanding and this request adds "
                f"{tokens} (--max-queued-tokens {limit}); retry later"
            )
        admission.tokens += tokens
        self.tokens += tokens
        return self

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission.requests -= 1
            self._admission.tokens -= self.tokens


class Admission:
    """Outstanding requests and tokens, and the limits beyond which new ones get a 429."""

    def __init__(self, max_requests: int | None = None, max_tokens: int | None = None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0

    def admit(self, tokens: int) -> Ticket:
        """Count a request of ``tokens``, or raise the 429 :class:`APIError`."""
        if self.max_requests is not None and self.requests >= self.max_requests:
            raise _overloaded(
                f"the server has {self.requests} requests outstanding "
                f"(--max-queued-requests {self.max_requests}); retry later"
            )
        if (
            self.max_tokens is not None
            and self.requests > 0
            and self.tokens + tokens > self.max_tokens
        ):
            raise _overloaded(
                f"the server has {self.tokens} tokens outstanding and this request adds "
                f"{tokens} (--max-queued-tokens {self.max_tokens}); retry later"
            )
        self.requests += 1
        self.tokens += tokens
        return Ticket(self, tokens)


def _overloaded(message: str) -> APIError:
    return APIError(
        429,
        message,
        type="server_error",
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def timeout_error(timeout_s: float) -> APIError:
    """The 504 of a request that ran past ``--request-timeout``."""
    return APIError(
        504,
        f"the request did not finish within {timeout_s:g} s (--request-timeout); it was cancelled",
        type="server_error",
        code="request_timeout",
    )


async def with_deadline(
    frames: AsyncGenerator[bytes, None], deadline: float | None, timeout_s: float | None
) -> AsyncGenerator[bytes, None]:
    """``frames`` until the loop time ``deadline`` (``None``: none); see the module docstring."""
    started = False
    async with contextlib.aclosing(frames):
        while True:
            try:
                if deadline is None:
                    frame = await anext(frames)
                else:
                    async with asyncio.timeout_at(deadline):
                        frame = await anext(frames)
            except StopAsyncIteration:
                return
            except TimeoutError:
                error = timeout_error(timeout_s or 0.0)
                if not started:
                    raise error from None
                yield sse(json.dumps(error.body()))
                yield sse("[DONE]")
                return
            started = True
            yield frame

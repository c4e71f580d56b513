"""The current HTTP request's id, for response headers and log lines.

:mod:`server.http.middleware` sets :data:`request_id_var` per request; tasks started while
handling it inherit it. :class:`RequestIdFilter` copies it to ``record.request_id`` (``-``
outside a request), for ``%(request_id)s`` in log formats.

:func:`posts_in_flight` counts POSTs let in and not yet answered, over every app of this
process: the batcher skips its window only when the request it holds is the only one.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Iterator
from contextvars import ContextVar

request_id_var: ContextVar[str | None] = ContextVar("shardserve_request_id", default=None)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_posts = [0]  # POST requests in flight (a list: no global statement needed)


@contextlib.contextmanager
def post_in_flight() -> Iterator[None]:
    """Count one POST request in :func:`posts_in_flight` while the block runs."""
    _posts[0] += 1
    try:
        yield
    finally:
        _posts[0] -= 1


def posts_in_flight() -> int:
    return _posts[0]


def choose_request_id(client_value: str | None) -> str:
    """The client's ``X-Request-Id`` if it is short and printable, else a fresh one."""
    if client_value is not None and _CLIENT_ID.fullmatch(client_value):
        return client_value
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to each record it sees; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get() or "-"
        return True

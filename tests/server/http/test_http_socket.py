"""The HTTP socket ``shardserve serve`` binds: every connection it accepts is TCP_NODELAY.

Without it (a socket created with protocol 0, asyncio leaves Nagle on) an SSE frame
written right after the response headers waits for the client's delayed ACK.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from server.cli.serve import _bind
from tests.waiting import async_wait_until

pytestmark = pytest.mark.timeout(30)


async def test_accepted_connections_have_nodelay() -> None:
    loop = asyncio.get_running_loop()
    nodelay: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    listener = _bind("127.0.0.1", 0)
    server = await loop.create_server(Probe, sock=listener)  # as uvicorn serves it
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        await async_wait_until(lambda: bool(nodelay), "the connection to be accepted")
        assert nodelay[0] != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()

"""Rank 0's ZMQ service loop, shared by the generation and embedding coordinators.

Rank 0 binds a ROUTER; each frontend connects a DEALER (see
:mod:`model_shards.messages`). The loop answers ``Hello`` with the engine's
``EngineReady``, hands every other message to the engine, runs the engine
while it has work and, while idle, lets it send keep-alive plans so the
workers' collective timeouts only fire on a real failure.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq

from model_shards.messages import (
    EngineError,
    EngineMessage,
    EngineReady,
    FrontendMessage,
    Hello,
    Shutdown,
    decode_frontend_message,
    encode,
)

log = logging.getLogger(__name__)

Reply = tuple[bytes, EngineMessage]  # (frontend identity, message)


class FrontendEngine(Protocol):
    keepalive_s: float

    def ready(self) -> EngineReady: ...

    def handle(self, message: FrontendMessage, client: bytes) -> list[Reply]: ...

    def has_work(self) -> bool: ...

    def work(self) -> list[Reply]: ...

    def keepalive(self) -> None: ...

    def shutdown(self) -> None: ...


def serve_frontends(engine: FrontendEngine, address: str) -> None:
    """Serve until a ``Shutdown`` message, then stop every rank (``engine.shutdown()``)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    clients: set[bytes] = set()
    log.info("rank 0 serving on %s", address)

    def send(replies: list[Reply]) -> None:
        for client, message in replies:
            sock.send_multipart([client, encode(message)])

    try:
        running = True
        while running:
            timeout_ms = 0 if engine.has_work() else int(engine.keepalive_s * 1000 / 2)
            while running and sock.poll(timeout_ms):
                timeout_ms = 0
                client, payload = sock.recv_multipart()
                clients.add(client)
                message = decode_frontend_message(payload)
                if isinstance(message, Hello):
                    send([(client, engine.ready())])
                elif isinstance(message, Shutdown):
                    running = False
                else:
                    send(engine.handle(message, client))
            if engine.has_work():
                send(engine.work())
            else:
                engine.keepalive()
        engine.shutdown()
    except Exception as exc:
        # A rank failed: its peers' collectives time out and they exit too.
        log.exception("engine failed")
        send([(client, EngineError(f"engine failed: {exc}")) for client in clients])
        raise
    finally:
        sock.close()
        ctx.term()

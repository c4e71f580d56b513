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


class FrontendSocket:
    """Rank 0's ROUTER: the frontends' messages in, replies out, every client remembered
    (each is told when the engine fails)."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.bind(address)
        self.clients: set[bytes] = set()

    def send(self, replies: list[Reply]) -> None:
        for client, message in replies:
            self._sock.send_multipart([client, encode(message)])

    def answer_waiting(self, engine: FrontendEngine, timeout_ms: int) -> bool:
        """Answer the messages waiting (the first waited for up to ``timeout_ms``):
        ``Hello`` with ``engine.ready()``, others by ``engine.handle``. ``False`` once a
        ``Shutdown`` came (what follows it stays unread)."""
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            client, payload = self._sock.recv_multipart()
            self.clients.add(client)
            message = decode_frontend_message(payload)
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, Hello):
                self.send([(client, engine.ready())])
            else:
                self.send(engine.handle(message, client))
        return True

    def fail(self, exc: Exception) -> None:
        """Tell every client the engine failed."""
        self.send([(client, EngineError(f"engine failed: {exc}")) for client in self.clients])

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


def serve_frontends(engine: FrontendEngine, address: str) -> None:
    """Serve until a ``Shutdown`` message, then stop every rank (``engine.shutdown()``)."""
    frontends = FrontendSocket(address)
    log.info("rank 0 serving on %s", address)
    try:
        running = True
        while running:
            timeout_ms = 0 if engine.has_work() else int(engine.keepalive_s * 1000 / 2)
            running = frontends.answer_waiting(engine, timeout_ms)
            if engine.has_work():
                frontends.send(engine.work())
            else:
                engine.keepalive()
        engine.shutdown()
    except Exception as exc:
        # A rank failed: its peers' collectives time out and they exit too.
        log.exception("engine failed")
        frontends.fail(exc)
        raise
    finally:
        frontends.close()

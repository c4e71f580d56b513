"""Rank 0's ZMQ service loop, shared by the generation and embedding coordinators.

Rank 0 binds a ROUTER; each frontend connects a DEALER (see
:mod:`model_shards.messages`). Every frame passes the port guard first
(:mod:`model_shards.engine.engine_port`: decoded in a guard, the connection
authenticated by the engine token on ``Hello``; a bad frame is dropped and its
sender told). The loop answers ``Hello`` with the engine's ``EngineReady``,
hands every other message to the engine, runs the engine while it has work
and, while idle, lets it send keep-alive plans so the workers' collective
timeouts only fire on a real failure.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import zmq

from model_shards.engine.engine_port import PortGuard, PortSettings
from model_shards.messages import (
    EngineError,
    EngineMessage,
    EngineReady,
    FrontendMessage,
    Hello,
    Shutdown,
    StepOutputs,
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
    """Rank 0's ROUTER: the frontends' messages in (through the port guard), replies out,
    every authenticated client remembered (each is told when the engine fails)."""

    def __init__(self, address: str, settings: PortSettings) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
        self._sock.bind(address)
        self.guard = PortGuard(settings.token)

    @property
    def clients(self) -> set[bytes]:
        return self.guard.authenticated

    def send(self, replies: list[Reply]) -> None:
        """Send each reply; a ``StepOutputs``' stats carry the port's rejected-frame count."""
        rejected = self.guard.rejected_total
        for client, message in replies:
            if isinstance(message, StepOutputs) and message.stats is not None:
                stats = msgspec.structs.replace(message.stats, rejected_messages=rejected)
                message = msgspec.structs.replace(message, stats=stats)
            self._sock.send_multipart([client, encode(message)])

    def answer_waiting(self, engine: FrontendEngine, timeout_ms: int) -> bool:
        """Answer the messages waiting (the first waited for up to ``timeout_ms``):
        ``Hello`` with ``engine.ready()``, others by ``engine.handle``, refused frames with
        the guard's ``EngineError``. ``False`` once an authenticated ``Shutdown`` came (what
        follows it stays unread)."""
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            client, message = self.guard.admit(self._sock.recv_multipart())
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, Hello):
                self.send([(client, engine.ready())])
            elif isinstance(message, EngineError):
                self.send([(client, message)])
            else:
                self.send(engine.handle(message, client))
        return True

    def fail(self, exc: Exception) -> None:
        """Tell every client the engine failed."""
        self.send([(client, EngineError(f"engine failed: {exc}")) for client in self.clients])

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


def serve_frontends(engine: FrontendEngine, address: str, settings: PortSettings) -> None:
    """Serve until an authenticated ``Shutdown``, then stop every rank (``engine.shutdown()``)."""
    frontends = FrontendSocket(address, settings)
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

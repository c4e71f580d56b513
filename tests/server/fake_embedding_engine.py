"""A scripted encoder replica: :class:`FakeEngine`'s socket and thread, answering embeddings.

:class:`FakeEmbeddingEngine` announces ``task="embed"`` and answers every queued
input of a ``SubmitEmbeddings`` on its next step with :func:`fake_vector` of its
token ids, except while ``hold`` is true: then inputs stay queued until
:meth:`FakeEmbeddingEngine.release` (a slow engine that tests control, rather
than a clock). An ``AbortRequests`` drops the inputs still queued, as
``model_shards/engine/embedding_coordinator.py`` does, and is recorded in ``aborted``;
with ``drops_aborted=False`` they are answered anyway (as the real replica
answers an input already in a running batch). Answered ids are recorded in
``embedded``. It ignores generation (the frontend refuses that on an embedding
model before anything reaches the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from model_shards.messages import (
    AbortRequests,
    EmbeddingOutputs,
    EmbeddingResult,
    EmbedRequest,
    EngineReady,
    Hello,
    Shutdown,
    SubmitEmbeddings,
    decode_frontend_message,
    encode,
)
from tests.server.fake_engine import FakeEngine


def fake_vector(token_ids: list[int]) -> list[float]:
    """``[number of tokens, sum of ids, 1.0]``: predictable from the input."""
    return [float(len(token_ids)), float(sum(token_ids)), 1.0]


@dataclass
class FakeEmbeddingEngine(FakeEngine):
    hold: bool = False
    drops_aborted: bool = True
    embedded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._queued: dict[str, tuple[bytes, EmbedRequest]] = {}

    @property
    def queued_ids(self) -> list[str]:
        """Inputs received and not yet answered or aborted (a snapshot)."""
        return list(self._queued)

    def release(self) -> None:
        """Stop holding: the queued inputs (and later ones) are answered from the next step."""
        self.hold = False

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        peer, payload = sock.recv_multipart()
        message = decode_frontend_message(payload)
        if isinstance(message, Hello):
            self.hellos += 1
            self._peers_waiting.append(peer)
            if self.ready:
                self._become_ready(sock)
        elif isinstance(message, SubmitEmbeddings):
            for request in message.requests:
                self._queued[request.request_id] = (peer, request)
        elif isinstance(message, AbortRequests):
            for rid in message.request_ids:
                self.aborted.append(rid)
                if self.drops_aborted:
                    self._queued.pop(rid, None)
        elif isinstance(message, Shutdown):
            self.shutdowns += 1

    def vector(self, request: EmbedRequest) -> list[float]:
        """What the engine answers ``request`` with."""
        return fake_vector(request.token_ids)

    def announce(self) -> EngineReady:
        """The ``EngineReady`` this engine sends."""
        return EngineReady(self.max_model_len, self.vocab_size, [], task="embed")

    def _become_ready(self, sock: zmq.Socket[bytes]) -> None:
        self.ready = True
        ready = self.announce()
        for peer in self._peers_waiting:
            sock.send_multipart([peer, encode(ready)])
        self._peers_waiting = []

    def _step(self, sock: zmq.Socket[bytes]) -> None:
        if self.hold:
            return
        by_peer: dict[bytes, list[EmbeddingResult]] = {}
        for rid, (peer, request) in list(self._queued.items()):
            ids = request.token_ids
            result = EmbeddingResult(rid, self.vector(request), len(ids))
            by_peer.setdefault(peer, []).append(result)
            self.embedded.append(rid)
            del self._queued[rid]
        for peer, results in by_peer.items():
            sock.send_multipart([peer, encode(EmbeddingOutputs(results))])

"""Rank 0's engine port guard: who may talk to the engine, and which frames reach it.

Every multipart message rank 0's ROUTER receives goes through :meth:`PortGuard.admit`:

* exactly two frames (the peer's routing id, one payload), the payload a
  :data:`~model_shards.messages.FrontendMessage` (msgpack, decoded by
  :func:`~model_shards.messages.decode_frontend_message`); anything else is dropped;
* a ``Hello`` whose ``token`` equals the engine token (constant-time compare) authenticates
  its connection (its routing id); any other message from a connection that has not been
  authenticated is dropped, so without the token nothing is submitted, aborted or shut down.
  A ``Hello`` with a wrong token takes the authentication away again;
* a dropped frame is counted by reason (:attr:`PortGuard.rejected`, summed into
  ``EngineStats.rejected_messages``), logged at most every ``LOG_EVERY_S`` and answered with an
  ``EngineError`` naming the reason (the sender's own connection only).

Frames over :attr:`PortSettings.max_message_bytes` never reach the guard: libzmq closes the
connection that sends one before reading it (``ZMQ_MAXMSGSIZE``). Clients set a random routing
id (16 bytes): the ROUTER's own ids are a predictable counter, and an authenticated id must not
be claimable by another peer after its connection drops (a ``Hello`` from a ROUTER-assigned
or short id is refused).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from model_shards.messages import (
    ENGINE_TOKEN_ENV,
    EngineError,
    FrontendMessage,
    Hello,
    decode_frontend_message,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_ENV = "SHARDSERVE_ENGINE_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 2 * 2**30  # a batch of preprocessed images fits
MIN_ROUTING_ID_BYTES = 16
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class PortSettings:
    """The engine port's secret and frame size limit, as rank 0 reads them at start-up."""

    token: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @staticmethod
    def from_environment(environ: Mapping[str, str]) -> PortSettings:
        """``$SHARDSERVE_ENGINE_TOKEN`` (required) and ``$SHARDSERVE_ENGINE_MAX_MESSAGE_BYTES``;
        ``ValueError`` naming the variable when one is missing or bad."""
        token = environ.get(ENGINE_TOKEN_ENV, "")
        if not token:
            raise ValueError(f"${ENGINE_TOKEN_ENV} is not set: rank 0 serves no open port")
        text = environ.get(MAX_MESSAGE_ENV, str(DEFAULT_MAX_MESSAGE_BYTES))
        if not (text.isascii() and text.isdigit() and int(text) > 0):
            raise ValueError(f"${MAX_MESSAGE_ENV} must be a positive byte count, got {text!r}")
        return PortSettings(token, int(text))


class PortGuard:
    """Decodes, authenticates and counts what arrives on the engine port (module docstring)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.authenticated: set[bytes] = set()
        self.rejected: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._next_log = 0.0

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def admit(self, frames: list[bytes]) -> tuple[bytes, FrontendMessage | EngineError]:
        """``(peer, message)`` for a frame the engine may act on, else ``(peer, the
        EngineError to send back)``; a ``Hello`` comes back only when it authenticated."""
        peer = frames[0]
        if len(frames) != 2:
            return peer, self._drop("frame_count", f"expected 1 frame, got {len(frames) - 1}")
        try:
            message = decode_frontend_message(frames[1])
        except Exception as exc:  # any bytes at all: never let one take rank 0 down
            return peer, self._drop("undecodable", f"{type(exc).__name__}: {exc}"[:200])
        if isinstance(message, Hello):
            if len(peer) < MIN_ROUTING_ID_BYTES or peer[0] == 0:  # 0: the ROUTER's own ids
                what = f"set a random routing id of {MIN_ROUTING_ID_BYTES}+ bytes"
                return peer, self._drop("routing_id", what)
            if hmac.compare_digest(message.token.encode(), self._token):
                self.authenticated.add(peer)
                return peer, message
            self.authenticated.discard(peer)
            return peer, self._drop("bad_token", "Hello with a wrong engine token")
        if peer not in self.authenticated:
            what = type(message).__name__
            return peer, self._drop("unauthenticated", f"{what} before an accepted Hello")
        return peer, message

    def _drop(self, reason: str, detail: str) -> EngineError:
        """Count, log (rate-limited) and describe one dropped frame."""
        self.rejected[reason] += 1
        self._unlogged[reason] += 1
        now = time.monotonic()
        if now >= self._next_log:
            counts = ", ".join(f"{k} {n}" for k, n in sorted(self._unlogged.items()))
            log.warning(
                "engine port: dropped a frame (%s: %s); since last report: %s",
                reason,
                detail,
                counts,
            )
            self._unlogged.clear()
            self._next_log = now + LOG_EVERY_S
        return EngineError(f"engine port refused the message: {reason} ({detail})")

"""Data parallel: one frontend, several replicas, each request to the least-loaded one.

:class:`Router` holds one :class:`~server.engine.client.EngineClient` per
replica and is itself an :class:`~server.engine.client.Engine`, so the
routes cannot tell one replica from several. Contracts:

* **Load** is a replica's *outstanding tokens*: for every request routed to it
  and not yet finished, the prompt tokens not yet prefilled plus the tokens it
  may still generate (``max_tokens`` minus those already out). A request goes
  to the healthy replica with the fewest; ties go round-robin, so an idle
  server still spreads requests.
* **Health**: ready once every replica answered ``EngineReady`` (they must agree
  on vocabulary, context length and EOS ids: they serve one model); healthy
  while every replica is healthy (a dead replica makes ``/health`` 503, so an
  orchestrator or the operator sees it), but requests are routed only to
  healthy replicas meanwhile. With none healthy, a request goes to the least
  loaded *serviceable* one (a replica being restarted by its
  :class:`~server.engine.supervisor.ReplicaSupervisor`, where it waits); with none
  serviceable, ``generate`` raises :class:`~server.engine.client.EngineDeadError`.
* **Metrics** (when given): ``shardserve_replica_requests_total{replica}`` and
  ``shardserve_replica_outstanding_tokens{replica}``, replicas numbered in the
  order given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from model_shards.messages import (
    EmbeddingResult,
    EmbedRequest,
    EngineReady,
    GenerateRequest,
    RequestOutput,
)
from server.engine.client import Engine, EngineDeadError
from server.http.metrics import Metrics


class Replica(Engine, Protocol):
    """One replica behind the router: an :class:`~server.engine.client.EngineClient`
    or a :class:`~server.engine.supervisor.ReplicaSupervisor`."""

    @property
    def address(self) -> str: ...

    @property
    def num_pending(self) -> int: ...

    async def connect(self, timeout_s: float = 300.0) -> EngineReady: ...

    async def close(self, *, send_shutdown: bool = False) -> None: ...


class Router:
    """Route requests over ``clients`` (one per replica); ``await connect()`` first."""

    def __init__(self, clients: Sequence[Replica], metrics: Metrics | None = None) -> None:
        if not clients:
            raise ValueError("a router needs at least one replica")
        self.clients = list(clients)
        # per replica: routed requests and outstanding tokens, their label looked up once
        # (the gauge is set on every streamed token)
        self._routed = (
            []
            if metrics is None
            else [metrics.replica_requests.labels(replica=str(r)) for r in range(len(clients))]
        )  # a replica's counter shows 0 before its first request
        self._outstanding_gauges = (
            []
            if metrics is None
            else [metrics.replica_outstanding.labels(replica=str(r)) for r in range(len(clients))]
        )
        self._info: EngineReady | None = None
        self._outstanding = [0] * len(clients)
        self._where: dict[str, int] = {}  # request id -> replica
        self._next = 0  # round-robin start among equally loaded replicas
        for replica in range(len(clients)):
            self._publish(replica)

    # ---- state ---------------------------------------------------------------

    @property
    def info(self) -> EngineReady | None:
        return self._info

    @property
    def healthy(self) -> bool:
        return self._info is not None and all(c.healthy for c in self.clients)

    @property
    def serviceable(self) -> bool:
        """Ready, and some replica can take a request (now or after its recovery)."""
        return self._info is not None and any(c.serviceable for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        for replica, client in enumerate(self.clients):
            if not client.healthy and client.dead_reason is not None:
                return self._name(replica, client.dead_reason)
        return None

    @property
    def outstanding_tokens(self) -> list[int]:
        """Each replica's load, as defined in the module docstring."""
        return list(self._outstanding)

    @property
    def num_pending(self) -> int:
        return sum(c.num_pending for c in self.clients)

    # ---- lifecycle -----------------------------------------------------------

    async def connect(self, timeout_s: float = 300.0) -> EngineReady:
        """Wait until every replica is ready (raises as :meth:`EngineClient.connect` does).

        :class:`EngineDeadError` if the replicas do not serve the same model.
        """
        results = await asyncio.gather(
            *(c.connect(timeout_s=timeout_s) for c in self.clients), return_exceptions=True
        )
        for replica, result in enumerate(results):
            if isinstance(result, EngineDeadError | TimeoutError):
                raise type(result)(self._name(replica, str(result))) from result
            if isinstance(result, BaseException):
                raise result
        readies = [r for r in results if isinstance(r, EngineReady)]
        first = readies[0]
        for replica, ready in enumerate(readies):
            if ready != first:
                problem = f"serves another model: {ready} != {first}"
                raise EngineDeadError(self._name(replica, problem))
        self._info = first
        return first

    async def close(self, *, send_shutdown: bool = False) -> None:
        """Close every client (``send_shutdown`` stops replicas this frontend started)."""
        await asyncio.gather(*(c.close(send_shutdown=send_shutdown) for c in self.clients))

    # ---- requests ------------------------------------------------------------

    def pick(self) -> int:
        """The healthy replica with the fewest outstanding tokens (ties: round-robin);
        with none healthy, the least loaded serviceable one (it is recovering)."""
        n = len(self.clients)
        healthy = [r for r in range(n) if self.clients[r].healthy]
        if not healthy:
            healthy = [r for r in range(n) if self.clients[r].serviceable]
        if not healthy:
            raise EngineDeadError(self.dead_reason or "no replica is ready")
        replica = min(healthy, key=lambda r: (self._outstanding[r], (r - self._next) % n))
        self._next = (replica + 1) % n
        return replica

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Route ``request`` to :meth:`pick`'s replica and yield its outputs.

        Closing this early closes the replica's stream, which aborts the request.
        """
        replica = self.pick()
        prompt_left = len(request.prompt_token_ids)
        tokens_left = request.max_tokens
        self._add(replica, prompt_left + tokens_left)
        self._where[request.request_id] = replica
        if self._routed:
            self._routed[replica].inc()
        try:
            source = self.clients[replica].generate(request)
            async with contextlib.aclosing(source):
                async for output in source:  # any output means the prompt is prefilled
                    new = min(len(output.new_token_ids), tokens_left)
                    self._add(replica, -(prompt_left + new))
                    prompt_left, tokens_left = 0, tokens_left - new
                    yield output
        finally:
            self._add(replica, -(prompt_left + tokens_left))
            self._where.pop(request.request_id, None)

    async def embed(self, request: EmbedRequest) -> EmbeddingResult:
        """Embed on :meth:`pick`'s replica (its prompt counts as outstanding until done)."""
        replica = self.pick()
        tokens = len(request.token_ids)
        self._add(replica, tokens)
        if self._routed:
            self._routed[replica].inc()
        try:
            return await self.clients[replica].embed(request)
        finally:
            self._add(replica, -tokens)

    def abort(self, request_ids: list[str]) -> None:
        """Abort each request on the replica it went to. Never awaits."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if (replica := self._where.get(rid)) is not None:
                by_replica.setdefault(replica, []).append(rid)
        for replica, rids in by_replica.items():
            self.clients[replica].abort(rids)

    # ---- internals -----------------------------------------------------------

    def _add(self, replica: int, tokens: int) -> None:
        self._outstanding[replica] += tokens
        self._publish(replica)

    def _publish(self, replica: int) -> None:
        if self._outstanding_gauges:
            self._outstanding_gauges[replica].set(self._outstanding[replica])

    def _name(self, replica: int, reason: str) -> str:
        return f"replica {replica} ({self.clients[replica].address}): {reason}"

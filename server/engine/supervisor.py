"""Keep one spawned replica serving: notice a dead rank, restart the replica, replay requests.

:class:`ReplicaSupervisor` stands where an :class:`~server.engine.client.EngineClient`
stands behind the :class:`~server.engine.router.Router`, for a replica this frontend
started (``shardserve serve`` without ``--engine``). Contracts:

* **Noticing**: the engine client polls the ranks' processes every 0.5 s and
  names the first dead one (``rank 3 (pid N) killed by SIGKILL``); the
  supervisor has it check them every ``poll_s`` (0.1 s) too
  (:meth:`~server.engine.client.EngineClient.check_liveness`). From then on
  :attr:`healthy` is false (``/health`` 503) until the replica is back.
* **Recovery**: every rank of the old replica is stopped (SIGTERM, then SIGKILL;
  none is left behind), then the same replica is started again
  (:meth:`model_shards.launch.replicas.ReplicaHandle.respawn`) and connected, after a
  back-off of ``backoff_s * 2**k`` seconds (capped at ``max_backoff_s``) before
  attempt ``k``. At most ``max_restarts`` attempts per incident; the count
  starts again once a recovered replica has served ``stable_s`` seconds.
* **Replay**: a request in flight when the replica failed is submitted again
  to the recovered replica with its prompt, ``max_tokens`` unchanged and
  ``resume_output_ids`` = every token it had produced; the engine continues
  exactly where it stopped (the frontend always sets a seed), and only new
  tokens come back, so the caller sees one gap-free, duplicate-free stream.
  Requests arriving during recovery wait for it (bounded by
  ``--request-timeout``, if set).
* **Giving up**: when the attempts are exhausted, every waiting and in-flight
  request fails with :class:`~server.engine.client.EngineDeadError` (a 503),
  :attr:`serviceable` turns false and later requests fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import msgspec

from model_shards.messages import (
    EmbeddingResult,
    EmbedRequest,
    EngineReady,
    GenerateRequest,
    RequestOutput,
)
from server.engine.client import EngineClient, EngineDeadError

logger = logging.getLogger(__name__)


class SpawnedReplica(Protocol):
    """What the supervisor uses of :class:`model_shards.launch.replicas.ReplicaHandle`."""

    @property
    def address(self) -> str: ...

    def is_alive(self) -> bool: ...

    def death(self) -> str | None: ...

    def pids(self) -> list[int | None]: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def exitcodes(self) -> list[int | None]: ...

    def respawn(self) -> SpawnedReplica: ...


ClientFactory = Callable[[SpawnedReplica], EngineClient]


class ReplicaSupervisor:
    """One spawned replica, restarted when a rank dies; ``await connect()`` first."""

    def __init__(
        self,
        handle: SpawnedReplica,
        make_client: ClientFactory,
        *,
        name: str = "replica 0",
        max_restarts: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        ready_timeout_s: float = 300.0,
        stable_s: float = 60.0,
        poll_s: float = 0.1,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.name = name
        self._make_client = make_client
        self._client = make_client(handle)
        self._max_restarts = max_restarts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._ready_timeout_s = ready_timeout_s
        self._stable_s = stable_s
        self._poll_s = poll_s
        self._on_down = on_down
        self._attempts = 0
        self._up_since = time.monotonic()
        self._recovering: str | None = None  # why, while recovering
        self._given_up: str | None = None
        self._closing = False
        self._pending = 0
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self.restarts = 0  # successful restarts so far

    # ---- state ---------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.handle.address

    @property
    def info(self) -> EngineReady | None:
        return self._client.info

    @property
    def healthy(self) -> bool:
        """Serving now: not recovering, not given up, the current client healthy."""
        return self._recovering is None and self._given_up is None and self._client.healthy

    @property
    def serviceable(self) -> bool:
        """A request submitted now will be served, perhaps after the recovery under way."""
        return self._given_up is None and not self._closing

    @property
    def dead_reason(self) -> str | None:
        if self._given_up is not None:
            return self._given_up
        if self._recovering is not None:
            return f"recovering from: {self._recovering}"
        return self._client.dead_reason

    @property
    def num_pending(self) -> int:
        return self._pending

    # ---- lifecycle -----------------------------------------------------------

    async def connect(self, timeout_s: float = 300.0) -> EngineReady:
        """Wait for the first ``EngineReady`` (as :meth:`EngineClient.connect`), then watch."""
        ready = await self._client.connect(timeout_s=timeout_s)
        self._up_since = time.monotonic()
        self._monitor = asyncio.create_task(self._watch(), name=f"supervisor-{self.name}")
        return ready

    async def close(self, *, send_shutdown: bool = False) -> None:
        """Stop watching, close the client; with ``send_shutdown`` also stop every rank."""
        self._closing = True
        self._notify()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await self._client.close(send_shutdown=send_shutdown)
        if send_shutdown:
            await asyncio.to_thread(self.handle.stop)

    # ---- requests ------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yield ``request``'s outputs, replaying it after a replica failure (module docs)."""
        produced: list[int] = []
        self._pending += 1
        try:
            while True:
                client = await self._serving_client()
                replay = request
                if produced:
                    resumed = [*request.resume_output_ids, *produced]
                    # the first output, gone out already, carried the prompt's scores
                    replay = msgspec.structs.replace(
                        request, resume_output_ids=resumed, prompt_logprobs=None
                    )
                    logger.warning(
                        "%s: replaying request %s after %d token(s)",
                        self.name,
                        request.request_id,
                        len(produced),
                    )
                try:
                    source = client.generate(replay)
                    async with contextlib.aclosing(source):
                        async for output in source:
                            produced.extend(output.new_token_ids)
                            yield output
                    return
                except EngineDeadError:
                    if self._closing or self._given_up is not None:
                        raise
                    # the replica failed under this request: wait for the recovery, replay
        finally:
            self._pending -= 1

    async def embed(self, request: EmbedRequest) -> EmbeddingResult:
        """Embed on the current replica; after a failure, again on the recovered one."""
        self._pending += 1
        try:
            while True:
                client = await self._serving_client()
                try:
                    return await client.embed(request)
                except EngineDeadError:
                    if self._closing or self._given_up is not None:
                        raise
        finally:
            self._pending -= 1

    def abort(self, request_ids: list[str]) -> None:
        """Abort on the current replica. Never awaits."""
        self._client.abort(request_ids)

    # ---- recovery ------------------------------------------------------------

    async def _serving_client(self) -> EngineClient:
        """The current client once healthy; waits through a recovery.

        :class:`EngineDeadError` once closing or given up.
        """
        while True:
            if self._closing:
                raise EngineDeadError("frontend is shutting down")
            if self._given_up is not None:
                raise EngineDeadError(self._given_up)
            if self.healthy:
                return self._client
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), self._poll_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _watch(self) -> None:
        while not self._closing and self._given_up is None:
            await asyncio.sleep(self._poll_s)
            if self._closing or self._client.check_liveness():
                continue
            reason = self._client.dead_reason or "engine stopped"
            death = self._client.rank_death()  # the cause, when rank 0 reported its effect first
            if death is not None and death not in reason:
                reason = f"{death}: {reason}"
            await self._recover(reason)

    async def _recover(self, reason: str) -> None:
        """Tear the replica down and start it again, as the module docstring says."""
        self._recovering = reason
        self._notify()
        if time.monotonic() - self._up_since >= self._stable_s:
            self._attempts = 0
        logger.error(
            "%s failed: %s; restarting it (--max-restarts %d)",
            self.name,
            reason,
            self._max_restarts,
        )
        if self._on_down is not None:
            self._on_down()
        await self._client.close()
        while not self._closing:
            if self._attempts >= self._max_restarts:
                await self._give_up(reason)
                return
            delay = min(self._backoff_s * 2**self._attempts, self._max_backoff_s)
            self._attempts += 1
            await asyncio.sleep(delay)
            client: EngineClient | None = None
            try:
                self.handle = await asyncio.to_thread(self.handle.respawn)
                client = self._make_client(self.handle)
                await client.connect(timeout_s=self._ready_timeout_s)
            except (EngineDeadError, TimeoutError, OSError, ValueError) as exc:
                reason = f"restart {self._attempts} failed: {exc}"
                logger.error("%s: %s", self.name, reason)
                if client is not None:
                    await client.close()
                continue
            self._client = client
            self._recovering = None
            self._up_since = time.monotonic()
            self.restarts += 1
            logger.info(
                "%s recovered (restart %d, attempt %d); rank pids %s at %s",
                self.name,
                self.restarts,
                self._attempts,
                self.handle.pids(),
                self.handle.address,
            )
            self._notify()
            return

    async def _give_up(self, reason: str) -> None:
        self._given_up = f"{self.name} is down after {self._attempts} restart(s): {reason}"
        self._recovering = None
        logger.error("%s; giving up (--max-restarts %d)", self._given_up, self._max_restarts)
        self._notify()
        await asyncio.to_thread(self.handle.stop, 0)

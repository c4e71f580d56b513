"""The frontend's connection to one replica's rank 0 (asyncio ZMQ DEALER).

:meth:`EngineClient.connect` sends ``Hello`` (with the engine token, from a random routing id:
rank 0 serves only connections it authenticated) and waits for ``EngineReady``; then three tasks:

* a sender draining one outbound queue: frames leave in order (a ``SubmitBatch`` precedes the
  aborts of its requests) and an abort never awaits (safe in a cancelled task's ``finally``);
* a receiver routing each output to its request's queue;
* a watchdog polling ``is_alive`` every ``liveness_interval_s`` when the frontend started the
  replica, else (``--engine``) a ``Hello`` every ``heartbeat_s``, the engine dead after
  ``heartbeat_timeout_s`` of silence.

:meth:`generate` yields outputs until one has a ``finish_reason``; closing it early aborts the
request. A refusal raises :class:`EngineRequestError`; a fatal ``EngineError`` or a dead replica
fails every pending request with :class:`EngineDeadError`, and :attr:`healthy` turns false for
good. Outputs of unknown (e.g. aborted) request ids are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from model_shards.messages import (
    AbortRequests,
    EmbeddingOutputs,
    EmbeddingResult,
    EmbedRequest,
    EngineError,
    EngineReady,
    EngineStats,
    GenerateRequest,
    Hello,
    RequestOutput,
    Shutdown,
    StepOutputs,
    SubmitBatch,
    SubmitEmbeddings,
    decode_engine_message,
    encode,
    random_routing_id,
)
from server.engine.batcher import Batcher
from server.http import ttft_trace
from server.http.request_context import posts_in_flight

logger = logging.getLogger(__name__)

_Item = RequestOutput | EmbeddingResult | BaseException


class EngineDeadError(RuntimeError):
    """The replica is gone (process exit or fatal engine error); nothing more will come."""


class EngineRequestError(RuntimeError):
    """The engine refused (or ended) one request; the engine itself is fine. ``code``: the
    ``EngineError``'s (``grammar_*``: the request's grammar)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class Engine(Protocol):
    """What the routes use of an engine: one :class:`EngineClient` or a router over several."""

    @property
    def info(self) -> EngineReady | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def serviceable(self) -> bool:
        """Whether a request submitted now will be served (perhaps after a recovery)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_ids: list[str]) -> None: ...

    async def embed(self, request: EmbedRequest) -> EmbeddingResult: ...


class EngineClient:
    """One DEALER connection to a replica; create, ``await connect()``, use, ``await close()``."""

    def __init__(
        self,
        address: str,
        *,
        is_alive: Callable[[], bool] | None = None,
        batch_window_s: float = 0.002,
        max_batch_size: int = 256,
        liveness_interval_s: float = 0.5,
        heartbeat_s: float | None = None,
        heartbeat_timeout_s: float = 60.0,
        describe_death: Callable[[], str | None] | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
        token: str = "",
    ) -> None:
        """``token``: the engine token rank 0 checks on ``Hello``."""
        self.address = address
        self._hello = encode(Hello(token))
        self._describe_death = describe_death
        self._on_stats = on_stats
        self.info: EngineReady | None = None
        self._is_alive = is_alive
        self._liveness_interval_s = liveness_interval_s
        self._heartbeat_s = heartbeat_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._last_heard = time.monotonic()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, random_routing_id())
        self._sock.connect(address)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._batcher = Batcher(
            self._send_batch, batch_window_s, max_batch_size, idle=self._nothing_on_engine
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None
        self._closing = False  # replica exit is expected from here on
        self._closed = False

    # ---- state ---------------------------------------------------------------

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is considered dead, or ``None`` while it is not."""
        return self._dead_reason

    @property
    def healthy(self) -> bool:
        """Ready, not closed, and no fatal error or death seen so far (no side effect: a
        dead replica is noticed by :meth:`check_liveness`, which the watchdog calls)."""
        return self.info is not None and self._dead_reason is None and not self._closed

    def rank_death(self) -> str | None:
        """Which rank of the replica died and how (``rank 3 (pid N) killed by SIGKILL``), when
        the replica's processes are known and one is gone; else ``None``."""
        return self._describe_death() if self._describe_death is not None else None

    def check_liveness(self) -> bool:
        """Poll ``is_alive`` (when given) and, if the replica is gone, mark this client dead for
        good, failing pending requests with :class:`EngineDeadError`; return :attr:`healthy`."""
        if self.healthy and self._is_alive is not None and not self._is_alive():
            self._mark_dead(self.rank_death() or "replica processes exited")
        return self.healthy

    @property
    def serviceable(self) -> bool:
        """Same as :attr:`healthy`: a lone client does not recover."""
        return self.healthy

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # ---- lifecycle -----------------------------------------------------------

    async def connect(self, timeout_s: float = 300.0, poll_s: float = 0.2) -> EngineReady:
        """Send ``Hello`` and wait for ``EngineReady``; :class:`EngineDeadError` if the replica
        dies or reports a fatal error first, ``TimeoutError`` after ``timeout_s``."""
        if self.info is not None:
            return self.info
        await self._sock.send(self._hello)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._is_alive is not None and not self._is_alive():
                raise EngineDeadError("replica processes exited before the engine was ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"engine at {self.address} not ready after {timeout_s:.0f} s")
            events = await self._sock.poll(int(min(poll_s, remaining) * 1000))  # POLLIN
            if not events:
                continue
            message = self._decode(await self._sock.recv_multipart())
            if isinstance(message, EngineReady):
                ready = self.info = message
                break
            if isinstance(message, EngineError) and message.request_id is None:
                raise EngineDeadError(f"engine failed to start: {message.message}")
            logger.warning("ignoring %s received before EngineReady", type(message).__name__)
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="engine-sender"),
            asyncio.create_task(self._recv_loop(), name="engine-receiver"),
        ]
        self._last_heard = time.monotonic()
        if self._is_alive is not None:
            self._tasks.append(asyncio.create_task(self._watch_loop(), name="engine-watchdog"))
        elif self._heartbeat_s is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="engine-heartbeat"))
        return ready

    async def close(self, *, send_shutdown: bool = False, drain_s: float = 1.0) -> None:
        """Fail pending requests, optionally send ``Shutdown`` (best-effort: queued frames get
        at most ``drain_s`` to leave) and release the socket. Idempotent."""
        if self._closed:
            return
        self._closing = True
        self._batcher.close()
        if send_shutdown and self._tasks and not self._tasks[0].done():
            self._outbox.put_nowait(encode(Shutdown()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), drain_s)
        elif send_shutdown:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(Shutdown()), flags=zmq.NOBLOCK)
        self._closed = True
        self._fail_all(EngineDeadError("frontend is shutting down"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sock.close(linger=int(drain_s * 1000) if send_shutdown else 0)
        self._ctx.term()

    # ---- requests ------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit ``request`` (batched) and yield its outputs until it finishes."""
        queue = self._open_stream(request.request_id)
        finished = False
        try:
            self._batcher.submit(ttft_trace.traced(request))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if not isinstance(item, RequestOutput):
                    finished = True
                    raise EngineRequestError("the engine answered a generation with an embedding")
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort([request.request_id])

    async def embed(self, request: EmbedRequest) -> EmbeddingResult:
        """Embed one input on an encoder replica."""
        queue = self._open_stream(request.request_id)
        answered = False
        try:
            self._outbox.put_nowait(encode(SubmitEmbeddings([request])))
            item = await queue.get()
            answered = True
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, EmbeddingResult):
                raise EngineRequestError("the engine answered an embedding with tokens")
            return item
        finally:
            self._streams.pop(request.request_id, None)
            if not answered:  # cancelled while waiting
                self.abort([request.request_id])

    def abort(self, request_ids: list[str]) -> None:
        """Stop generating for ``request_ids``. Never awaits; safe in ``finally`` blocks."""
        to_engine = [rid for rid in request_ids if not self._batcher.cancel(rid)]
        if to_engine and not self._closed and self._dead_reason is None:
            self._outbox.put_nowait(encode(AbortRequests(to_engine)))

    # ---- internals -----------------------------------------------------------

    def _open_stream(self, request_id: str) -> asyncio.Queue[_Item]:
        """The queue this request's engine messages will arrive on (checks liveness first)."""
        if not self.check_liveness():
            raise EngineDeadError(self._dead_reason or "engine is not ready")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id}")
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def _nothing_on_engine(self) -> bool:
        """Whether every open request is still in the batcher (none sent, unfinished) and
        no other POST is on its way through the frontend (a burst: let the window batch it)."""
        return len(self._streams) <= self._batcher.pending and posts_in_flight() <= 1

    def _send_batch(self, batch: list[GenerateRequest]) -> None:
        if not self._closed:
            self._outbox.put_nowait(encode(SubmitBatch(batch)))
            ttft_trace.mark_requests(batch, "batch_sent")

    def _decode(self, frames: list[bytes]) -> object:
        # ROUTER peers may or may not insert an empty delimiter frame: the payload is last.
        return decode_engine_message(frames[-1])

    async def _send_loop(self) -> None:
        while True:
            data = await self._outbox.get()
            try:
                await self._sock.send(data)
            finally:
                self._outbox.task_done()

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self._last_heard = time.monotonic()
            try:
                message = self._decode(frames)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("undecodable message from engine: %s", exc)
                continue
            self._dispatch(message)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            if message.stats is not None and self._on_stats is not None:
                self._on_stats(message.stats)
            for output in message.outputs:
                ttft_trace.engine_output(output)  # a dict lookup unless it is traced
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif isinstance(message, EmbeddingOutputs):
            for result in message.outputs:
                queue = self._streams.get(result.request_id)
                if queue is not None:
                    queue.put_nowait(result)
        elif isinstance(message, EngineError):
            if message.request_id is None:
                logger.error("fatal engine error: %s", message.message)
                # rank 0 often reports a peer it lost: a dead rank, if any, is the cause
                if self.check_liveness():
                    self._mark_dead(f"engine error: {message.message}")
            elif (queue := self._streams.get(message.request_id)) is not None:
                queue.put_nowait(EngineRequestError(message.message, message.code))
        elif isinstance(message, EngineReady):
            self.info = message

    async def _watch_loop(self) -> None:
        while self._dead_reason is None:
            await asyncio.sleep(self._liveness_interval_s)
            self.check_liveness()

    async def _heartbeat_loop(self) -> None:
        """``Hello`` every ``heartbeat_s`` (rank 0 answers between steps); silence = dead."""
        assert self._heartbeat_s is not None
        while self._dead_reason is None:
            await asyncio.sleep(self._heartbeat_s)
            silent = time.monotonic() - self._last_heard
            if silent > self._heartbeat_timeout_s:
                self._mark_dead(f"engine at {self.address} silent for {silent:.0f} s")
                return
            self._outbox.put_nowait(self._hello)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.log(logging.INFO if self._closing else logging.ERROR, "engine: %s", reason)
            self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)

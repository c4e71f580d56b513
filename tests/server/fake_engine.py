"""A scripted stand-in for a replica's rank 0, speaking the real wire protocol.

:class:`FakeEngine` binds a ZMQ ROUTER in a background thread. It answers
``Hello`` with ``EngineReady`` (at once, or when :meth:`FakeEngine.set_ready`
is called), and generates for each request, one token per step, the prompt's
ids with special ids removed, repeated (an "echo" model): the completion text
is therefore predictable from the prompt. It honours ``max_tokens``,
``max_model_len``, EOS (unless ``ignore_eos``), ``stop_token_ids`` and aborts,
and records what it received (``batches``, ``aborted``, ``shutdowns``) for
tests to assert on; ``on_hello`` tells a test (or another process) that a
frontend is now waiting for it. Finishing tokens (EOS / stop ids) are included
in the last output, as the real engine does. When ``sampling.logprobs`` is set,
each output carries :func:`fake_logprob` of its token (the same for every request); when
``prompt_logprobs`` is set, the first output carries :func:`fake_prompt_logprobs`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from model_shards.messages import (
    AbortRequests,
    EngineError,
    EngineReady,
    FinishReason,
    GenerateRequest,
    Hello,
    PromptLogprobs,
    RequestOutput,
    Shutdown,
    StepOutputs,
    SubmitBatch,
    TokenLogprob,
    decode_frontend_message,
    encode,
)


def fake_logprob(token: int, top_n: int, vocab_size: int) -> TokenLogprob:
    """Sampled token at -0.5; alternatives ``token, token+1, ...`` at -0.5, -1.5, ..."""
    ids = [(token + k) % vocab_size for k in range(top_n)]
    return TokenLogprob(-0.5, ids, [-0.5 - k for k in range(top_n)])


def fake_prompt_logprobs(prompt: list[int], top_n: int, vocab_size: int) -> PromptLogprobs:
    """Prompt token ``i >= 1`` at ``-0.25 - i``, rank ``i``; alternatives as
    :func:`fake_logprob`'s for that token, shifted by ``-i``."""
    rows = range(1, len(prompt))
    return PromptLogprobs(
        [-0.25 - i for i in rows],
        list(rows),
        [[(prompt[i] + k) % vocab_size for k in range(top_n)] for i in rows],
        [[-0.5 - k - i for k in range(top_n)] for i in rows],
    )


def echo_script(special_ids: set[int]) -> Callable[[GenerateRequest], list[int]]:
    """Outputs = the prompt without special ids, cycled (as many as the request may need)."""

    def script(request: GenerateRequest) -> list[int]:
        body = [t for t in request.prompt_token_ids if t not in special_ids] or [0]
        reps = request.max_tokens // len(body) + 1
        return (body * reps)[: request.max_tokens]

    return script


@dataclass
class _Active:
    request: GenerateRequest
    peer: bytes
    tokens: list[int]
    produced: int = 0


@dataclass
class FakeEngine:
    address: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int = 256
    special_ids: set[int] = field(default_factory=set)
    ready: bool = True
    step_s: float = 0.002
    refuse_token: int | None = None  # a prompt containing it is refused with EngineError
    on_hello: Callable[[], None] | None = None  # called on the engine thread at each Hello
    hellos: int = 0
    shutdowns: int = 0
    idle_polls: int = 0  # loop turns that found no message waiting (then it steps)
    batches: list[list[str]] = field(default_factory=list)
    requests: dict[str, GenerateRequest] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._script = echo_script(self.special_ids)
        self._lock = threading.Lock()
        self._commands: list[Callable[[zmq.Socket[bytes]], None]] = []
        self._stop = threading.Event()
        self._peers_waiting: list[bytes] = []
        self._active: dict[str, _Active] = {}
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._bound = threading.Event()

    # ---- control (any thread) ------------------------------------------------

    def start(self) -> FakeEngine:
        self._thread.start()
        if not self._bound.wait(10):
            raise RuntimeError("fake engine did not bind")
        return self

    def stop(self) -> None:
        """Stop the thread and close the socket (also how a test 'kills' the engine)."""
        self._stop.set()
        self._thread.join(10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def active_ids(self) -> list[str]:
        """Requests still generating (a snapshot)."""
        return list(self._active)

    def set_ready(self) -> None:
        self._command(lambda sock: self._become_ready(sock))

    def send_fatal(self, message: str) -> None:
        self._command(lambda sock: self._broadcast(sock, EngineError(message)))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    def _command(self, command: Callable[[zmq.Socket[bytes]], None]) -> None:
        with self._lock:
            self._commands.append(command)

    # ---- engine thread -------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(int(self.step_s * 1000) or 1):
                    self._receive(sock)
                    continue
                self.idle_polls += 1
                with self._lock:
                    commands, self._commands = self._commands, []
                for command in commands:
                    command(sock)
                self._step(sock)
        finally:
            sock.close(0)
            ctx.term()

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        peer, payload = sock.recv_multipart()
        message = decode_frontend_message(payload)
        if isinstance(message, Hello):
            self.hellos += 1
            if self.on_hello is not None:
                self.on_hello()
            self._peers_waiting.append(peer)
            if self.ready:
                self._become_ready(sock)
        elif isinstance(message, SubmitBatch):
            self.batches.append([r.request_id for r in message.requests])
            for request in message.requests:
                self._admit(sock, peer, request)
        elif isinstance(message, AbortRequests):
            for rid in message.request_ids:
                self.aborted.append(rid)
                if self._active.pop(rid, None) is not None:
                    out = RequestOutput(rid, [], finish_reason="abort")
                    sock.send_multipart([peer, encode(StepOutputs([out]))])
        elif isinstance(message, Shutdown):
            self.shutdowns += 1

    def _admit(self, sock: zmq.Socket[bytes], peer: bytes, request: GenerateRequest) -> None:
        self.requests[request.request_id] = request
        if self.refuse_token is not None and self.refuse_token in request.prompt_token_ids:
            error = EngineError("prompt contains a refused token", request.request_id)
            sock.send_multipart([peer, encode(error)])
            return
        self._active[request.request_id] = _Active(request, peer, self._script(request))

    def _become_ready(self, sock: zmq.Socket[bytes]) -> None:
        self.ready = True
        ready = EngineReady(self.max_model_len, self.vocab_size, list(self.eos_token_ids))
        for peer in self._peers_waiting:
            sock.send_multipart([peer, encode(ready)])
        self._peers_waiting = []

    def _broadcast(self, sock: zmq.Socket[bytes], message: EngineError) -> None:
        for peer in {a.peer for a in self._active.values()}:
            sock.send_multipart([peer, encode(message)])

    def _step(self, sock: zmq.Socket[bytes]) -> None:
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for rid, active in list(self._active.items()):
            request = active.request
            token = active.tokens[active.produced]
            active.produced += 1
            finish: FinishReason | None = None
            stops = set(request.stop_token_ids)
            if not request.ignore_eos:
                stops |= set(self.eos_token_ids)
            if token in stops:
                finish = "stop"
            elif active.produced >= request.max_tokens or (
                len(request.prompt_token_ids) + active.produced >= self.max_model_len
            ):
                finish = "length"
            first = active.produced == 1
            top_n = request.sampling.logprobs
            logprobs = None if top_n is None else [fake_logprob(token, top_n, self.vocab_size)]
            output = RequestOutput(
                rid, [token], finish, len(request.prompt_token_ids) if first else 0, logprobs
            )
            if first and request.prompt_logprobs is not None:
                scores = fake_prompt_logprobs(
                    request.prompt_token_ids, request.prompt_logprobs, self.vocab_size
                )
                output = msgspec.structs.replace(output, prompt_logprobs=scores)
            by_peer.setdefault(active.peer, []).append(output)
            if finish is not None:
                del self._active[rid]
        for peer, outputs in by_peer.items():
            sock.send_multipart([peer, encode(StepOutputs(outputs))])

"""A raw ZMQ client of a live engine port, for tests that send it what a frontend never would.

:class:`Peer` is one DEALER connection (a random routing id unless told otherwise): send any
frames, receive the engine's messages, say ``Hello``, run one request to its end.
:func:`live_engine` runs ``shardserve engine`` (torchrun, one node) on the tiny Llama with a
known token until its rank 0 answers, and stops it (no process left) on exit.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import zmq

from model_shards.launch.replicas import free_port
from model_shards.messages import (
    EngineError,
    EngineMessage,
    EngineReady,
    EngineStats,
    GenerateRequest,
    Hello,
    StepOutputs,
    SubmitBatch,
    decode_engine_message,
    encode,
    random_routing_id,
)
from tests.checkpoints import build_tiny_llama
from tests.deploy.multinode import engine_nodes, logs

READY_TIMEOUT_S = 240.0  # torchrun, the rank's start-up and (maybe) the CPU kernels' build


class Peer:
    """One DEALER on the engine port, with a random routing id (``assigned_id``: the ROUTER's)."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, assigned_id: bool = False
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if not assigned_id:
            self.sock.setsockopt(zmq.ROUTING_ID, random_routing_id())
        self.sock.connect(address)
        self.stats: EngineStats | None = None  # the latest StepOutputs' engine counters

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 30.0) -> EngineMessage | None:
        """The next message, ``None`` if none comes within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        message = decode_engine_message(self.sock.recv_multipart()[-1])
        if isinstance(message, StepOutputs) and message.stats is not None:
            self.stats = message.stats
        return message

    def hello(self, token: str, timeout_s: float = 30.0) -> EngineMessage | None:
        """Send ``Hello(token)``; the answer (other messages before it are skipped)."""
        self.send(encode(Hello(token)))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.recv(left)
            if message is None or isinstance(message, EngineReady | EngineError):
                return message
        return None

    def run(self, request: GenerateRequest, timeout_s: float = 60.0) -> tuple[list[int], str]:
        """Submit ``request``; its tokens and finish reason once it finishes, or ``([],
        "refused: <why>")`` when the engine refuses it."""
        self.send(encode(SubmitBatch([request])))
        return self.collect(request.request_id, timeout_s)

    def collect(self, request_id: str, timeout_s: float = 60.0) -> tuple[list[int], str]:
        """Receive until ``request_id`` finishes (see :meth:`run`)."""
        tokens: list[int] = []
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.recv(left)
            if isinstance(message, EngineError) and message.request_id == request_id:
                return tokens, f"refused: {message.message}"
            for out in message.outputs if isinstance(message, StepOutputs) else []:
                if out.request_id == request_id:
                    tokens += out.new_token_ids
                    if out.finish_reason is not None:
                        return tokens, out.finish_reason
        raise AssertionError(f"request {request_id} did not finish in {timeout_s} s")

    def close(self) -> None:
        self.sock.close()


@dataclass
class LiveEngine:
    address: str
    port: int
    token: str
    process: Popen[bytes]
    tmp_path: Path

    def log(self) -> str:
        return logs(self.tmp_path, 1)


@contextmanager
def live_engine(tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[LiveEngine]:
    """``shardserve engine`` (tp 1, CPU, default host) with a fresh token, once ready."""
    model_dir = build_tiny_llama(tmp_path / "llama")
    token, port = secrets.token_hex(16), free_port()
    args = ["--model", str(model_dir), "--device", "cpu", "--engine-port", str(port)]
    args += ["--max-model-len", "64", "--max-num-seqs", "8"]
    with engine_nodes([args], tmp_path, {"SHARDSERVE_ENGINE_TOKEN": token, **(env or {})}) as (p,):
        engine = LiveEngine(f"tcp://127.0.0.1:{port}", port, token, p, tmp_path)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        peer = Peer(ctx, engine.address)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not isinstance(peer.hello(token, 5.0), EngineReady):
                assert p.poll() is None and time.monotonic() < deadline, engine.log()
        finally:
            peer.close()
            ctx.term()
        yield engine

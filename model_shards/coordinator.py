"""Rank 0's loop: take requests, schedule, run a step on every rank, report tokens.

The engine step is three verbs — schedule, run, update::

    step = scheduler.schedule()          # rank 0 alone decides
    broadcast_plan(plan); worker.execute # every rank runs its stage
    scheduler.update(step, tokens)       # tokens back to the frontends

:meth:`Coordinator.serve` wraps this in a ZMQ ROUTER loop (see
:mod:`model_shards.messages`). While idle it broadcasts an empty plan every
``keepalive_s`` so the workers' collective timeout only fires on a real failure.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
import zmq

from model_shards.messages import (
    AbortRequests,
    EngineError,
    EngineReady,
    GenerateRequest,
    Hello,
    NewSequence,
    RequestOutput,
    SamplingParams,
    SeqChunk,
    Shutdown,
    StepOutputs,
    StepPlan,
    SubmitBatch,
    decode_frontend_message,
    encode,
)
from model_shards.scheduler.fifo import FifoScheduler, SeqUpdate
from model_shards.worker import StepResult, Worker, broadcast_plan

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self, worker: Worker, *, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int, keepalive_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.worker = worker
        self.ps = worker.ps
        cfg = worker.model.config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = cfg.eos_token_ids
        self.scheduler = FifoScheduler(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=cfg.eos_token_ids,
        )
        self.keepalive_s = keepalive_s
        self._step_id = 0
        self._last_plan_at = time.monotonic()
        self._clients: set[bytes] = set()  # ZMQ identities of connected frontends

    # ---- in-process API (used by serve() and by tests) ----------------------

    def check_request(self, req: GenerateRequest) -> str | None:
        """Why the engine refuses ``req``, or ``None`` (the frontend checks first)."""
        n = len(req.prompt_token_ids)
        if n == 0:
            return "prompt is empty"
        if n >= self.max_model_len:
            return f"prompt has {n} tokens; the context window is {self.max_model_len}"
        if any(not 0 <= t < self.vocab_size for t in req.prompt_token_ids):
            return f"prompt token ids must be in [0, {self.vocab_size})"
        if req.max_tokens < 1:
            return "max_tokens must be >= 1"
        s = req.sampling
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
            return "sampling parameters out of range"
        return None

    def add_request(self, req: GenerateRequest, client: bytes = b"") -> None:
        problem = self.check_request(req)
        if problem:
            raise ValueError(problem)
        self.scheduler.add(req, client)

    def abort(self, request_ids: list[str]) -> list[SeqUpdate]:
        return [
            SeqUpdate(seq, RequestOutput(seq.request.request_id, [], "abort"))
            for rid in request_ids
            if (seq := self.scheduler.abort(rid)) is not None
        ]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[SeqUpdate]:
        """One iteration over the running batch (also flushes pending frees)."""
        scheduled = self.scheduler.schedule()
        plan = StepPlan(
            step_id=self._next_step_id(),
            chunks=scheduled.chunks,
            new_sequences=scheduled.new_sequences,
            freed_seq_ids=scheduled.freed_seq_ids,
        )
        result = self._run(plan)
        return self.scheduler.update(scheduled, result.tokens.tolist())

    def prompt_logits(self, token_ids: list[int], seq_id: int = -1) -> torch.Tensor:
        """Float32 logits ``[vocab]`` after ``token_ids``, computed through every rank."""
        plan = StepPlan(
            step_id=self._next_step_id(),
            chunks=[SeqChunk(seq_id, 0, token_ids)],
            new_sequences=[NewSequence(seq_id, SamplingParams(temperature=0.0))],
            return_logits=True,
        )
        result = self._run(plan)
        self._run(StepPlan(step_id=self._next_step_id(), freed_seq_ids=[seq_id]))
        assert result.logits is not None
        return result.logits[0]

    def keepalive(self) -> None:
        """Broadcast an empty plan (and any pending frees) if none went out for a while."""
        if time.monotonic() - self._last_plan_at >= self.keepalive_s or (
            self.scheduler.has_pending_frees()
        ):
            self.step()

    def shutdown(self) -> None:
        """Tell every rank to leave its loop."""
        broadcast_plan(StepPlan(step_id=self._next_step_id(), shutdown=True), self.ps)

    def _run(self, plan: StepPlan) -> StepResult:
        broadcast_plan(plan, self.ps)
        self._last_plan_at = time.monotonic()
        result = self.worker.execute(plan)
        return result if result is not None else StepResult(torch.empty(0, dtype=torch.int64))

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    # ---- ZMQ loop -----------------------------------------------------------

    def serve(self, address: str) -> None:
        """Serve frontends on a ZMQ ROUTER at ``address`` until ``Shutdown``; then stop ranks."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.bind(address)
        ready = encode(EngineReady(self.max_model_len, self.vocab_size, list(self.eos_token_ids)))
        log.info("rank 0 serving on %s", address)
        try:
            running = True
            while running:
                timeout_ms = 0 if self.has_work() else int(self.keepalive_s * 1000 / 2)
                if sock.poll(timeout_ms):
                    running = self._drain(sock, ready)
                if self.has_work():
                    self._send(sock, self.step())
                else:
                    self.keepalive()
        except Exception as exc:
            log.exception("engine failed")
            for client in self._clients:
                sock.send_multipart([client, encode(EngineError(f"engine failed: {exc}"))])
            raise
        finally:
            try:
                self.shutdown()
            finally:
                sock.close()
                ctx.term()

    def _drain(self, sock: zmq.Socket[bytes], ready: bytes) -> bool:
        """Handle every queued frontend message; ``False`` on ``Shutdown``."""
        while True:
            try:
                client, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._clients.add(client)
            msg = decode_frontend_message(payload)
            if isinstance(msg, Hello):
                sock.send_multipart([client, ready])
            elif isinstance(msg, SubmitBatch):
                for req in msg.requests:
                    try:
                        self.add_request(req, client)
                    except ValueError as exc:
                        err = EngineError(str(exc), req.request_id)
                        sock.send_multipart([client, encode(err)])
            elif isinstance(msg, AbortRequests):
                self._send(sock, self.abort(msg.request_ids))
            elif isinstance(msg, Shutdown):
                return False

    def _send(self, sock: zmq.Socket[bytes], updates: list[SeqUpdate]) -> None:
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for update in updates:
            by_client[update.sequence.client].append(update.output)
        for client, outputs in by_client.items():
            sock.send_multipart([client, encode(StepOutputs(outputs))])

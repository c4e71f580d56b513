"""Rank 0's engine for an encoder replica: batch inputs, run them, reply.

Each step takes waiting inputs in arrival order while the batch stays within
``max_num_seqs`` inputs and ``max_num_batched_tokens`` padded tokens (an
input larger than the budget runs alone), broadcasts them in a plan, and
returns one ``EmbeddingOutputs`` per frontend. An embedding model's inputs get
their pooled vectors; a classifier's (``classify`` or ``score``) get its logits through
that task's activation (:func:`model_shards.models.bert.activate`).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import torch

from model_shards.engine.engine_port import PortSettings
from model_shards.engine.zmq_loop import Reply, serve_frontends
from model_shards.messages import (
    AbortRequests,
    EmbeddingOutputs,
    EmbeddingResult,
    EmbedRequest,
    EngineError,
    EngineReady,
    FrontendMessage,
    StepPlan,
    SubmitEmbeddings,
)
from model_shards.models.bert import activate
from model_shards.worker.decoder_worker import broadcast_plan
from model_shards.worker.encoder_worker import EncoderWorker


class EmbeddingCoordinator:
    def __init__(
        self,
        worker: EncoderWorker,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        keepalive_s: float = 10.0,
    ) -> None:
        self.worker = worker
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.config = worker.model.config
        self.vocab_size = self.config.vocab_size
        self.keepalive_s = keepalive_s
        self.waiting: deque[tuple[bytes, EmbedRequest]] = deque()
        self._step_id = 0
        self._last_plan_at = time.monotonic()

    def check_request(self, req: EmbedRequest) -> str | None:
        n = len(req.token_ids)
        if n == 0:
            return "input is empty"
        if n > self.max_model_len:
            return f"input has {n} tokens; the encoder takes at most {self.max_model_len}"
        if any(not 0 <= t < self.vocab_size for t in req.token_ids):
            return f"token ids must be in [0, {self.vocab_size})"
        types = self.config.type_vocab_size
        if req.token_type_ids and len(req.token_type_ids) != n:
            return f"{len(req.token_type_ids)} token type ids for {n} tokens"
        if any(not 0 <= t < types for t in req.token_type_ids):
            return f"token type ids must be in [0, {types})"
        return self._check_task(req)

    def _check_task(self, req: EmbedRequest) -> str | None:
        head = self.config.head
        if head is None:
            return None if req.task == "embed" else f"this replica embeds; cannot {req.task}"
        if req.task == "embed":
            return "this replica classifies; cannot embed"
        if req.task == "score" and head.num_labels != 1:
            return f"scoring needs a one-label cross-encoder; this one has {head.num_labels}"
        return None

    def ready(self) -> EngineReady:
        head = self.config.head
        labels = list(head.labels) if head is not None else []
        return EngineReady(self.max_model_len, self.vocab_size, [], self.config.task, labels)

    def handle(self, message: FrontendMessage, client: bytes) -> list[Reply]:
        if isinstance(message, SubmitEmbeddings):
            refused: list[Reply] = []
            for req in message.requests:
                problem = self.check_request(req)
                if problem:
                    refused.append((client, EngineError(problem, req.request_id)))
                else:
                    self.waiting.append((client, req))
            return refused
        if isinstance(message, AbortRequests):
            gone = {(client, rid) for rid in message.request_ids}  # only the sender's own
            self.waiting = deque(
                item for item in self.waiting if (item[0], item[1].request_id) not in gone
            )
            return []
        return [(client, EngineError(f"this replica embeds; cannot {type(message).__name__}"))]

    def has_work(self) -> bool:
        return bool(self.waiting)

    def work(self) -> list[Reply]:
        batch: list[tuple[bytes, EmbedRequest]] = []
        longest = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            longest_if = max(longest, len(self.waiting[0][1].token_ids))
            if batch and longest_if * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = longest_if
        vectors = self.pool([req for _, req in batch])
        by_client: dict[bytes, list[EmbeddingResult]] = defaultdict(list)
        for (client, req), vector in zip(batch, vectors, strict=True):
            by_client[client].append(EmbeddingResult(req.request_id, vector, len(req.token_ids)))
        return [(client, EmbeddingOutputs(out)) for client, out in by_client.items()]

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """In-process API (tests): embed token-id inputs through every rank."""
        return self._run(inputs).tolist()

    def pool(self, requests: list[EmbedRequest]) -> list[list[float]]:
        """Each checked request's vector: its embedding, or its logits through its task's
        activation (also the in-process API of tests)."""
        out = self._run([r.token_ids for r in requests], [r.token_type_ids for r in requests])
        head = self.config.head
        if head is None:
            return out.tolist()
        rows = []
        for req, row in zip(requests, out, strict=True):
            activation = head.score_activation if req.task == "score" else head.classify_activation
            rows.append(activate(row[None], activation)[0].tolist())  # [1, C] -> [C]
        return rows

    def keepalive(self) -> None:
        if time.monotonic() - self._last_plan_at >= self.keepalive_s:
            self._run([])

    def shutdown(self) -> None:
        broadcast_plan(
            StepPlan(self._next_step_id(), shutdown=True), self.worker.comm, self.worker.pending
        )
        self.worker.pending.wait_all()

    def serve(self, address: str, settings: PortSettings) -> None:
        serve_frontends(self, address, settings)

    def _run(self, inputs: list[list[int]], types: list[list[int]] | None = None) -> torch.Tensor:
        plan = StepPlan(self._next_step_id(), encode=inputs, encode_types=types or [])
        broadcast_plan(plan, self.worker.comm, self.worker.pending)
        self._last_plan_at = time.monotonic()
        out = self.worker.execute(plan)
        return out if out is not None else torch.empty(0, 0)

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

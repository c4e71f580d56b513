"""First-come-first-served iteration-level scheduler over a per-sequence KV cache.

Each step runs every running sequence's next token (decode) and admits waiting
sequences' whole prompts (prefill) while the step stays within
``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens (a prompt
larger than the budget runs alone). Requests join and leave between steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from model_shards.messages import (
    FinishReason,
    GenerateRequest,
    NewSequence,
    RequestOutput,
    SeqChunk,
)


@dataclass
class Sequence:
    seq_id: int
    request: GenerateRequest
    client: bytes = b""  # ZMQ identity of the frontend that submitted it
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens already in the KV cache
    sent: bool = False  # the ranks know this sequence (NewSequence was sent)

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_ids


@dataclass
class ScheduledStep:
    chunks: list[SeqChunk]
    sequences: list[Sequence]  # one per chunk, same order
    new_sequences: list[NewSequence]
    freed_seq_ids: list[int]


@dataclass
class SeqUpdate:
    sequence: Sequence
    output: RequestOutput


class FifoScheduler:
    def __init__(
        self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._to_free: list[int] = []
        self._next_seq_id = 0
        self._by_request: dict[str, Sequence] = {}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_frees(self) -> bool:
        return bool(self._to_free)

    def add(self, request: GenerateRequest, client: bytes = b"") -> Sequence:
        if request.request_id in self._by_request:
            raise ValueError(f"request id {request.request_id!r} is already running")
        seq = Sequence(self._next_seq_id, request, client)
        self._next_seq_id += 1
        self.waiting.append(seq)
        self._by_request[request.request_id] = seq
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.sent:
            self._to_free.append(seq.seq_id)
        return seq

    def schedule(self) -> ScheduledStep:
        chunks: list[SeqChunk] = []
        sequences: list[Sequence] = []
        for seq in self.running:  # decode: one new token each
            chunks.append(SeqChunk(seq.seq_id, seq.num_computed, seq.all_ids[seq.num_computed :]))
            sequences.append(seq)
        budget = self.max_num_batched_tokens - len(chunks)
        new: list[NewSequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prompt = seq.all_ids
            if len(prompt) > budget and chunks:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(SeqChunk(seq.seq_id, 0, prompt))
            sequences.append(seq)
            new.append(NewSequence(seq.seq_id, seq.request.sampling))
            seq.sent = True
            budget -= len(prompt)
        freed, self._to_free = self._to_free, []
        return ScheduledStep(chunks, sequences, new, freed)

    def update(self, step: ScheduledStep, tokens: list[int]) -> list[SeqUpdate]:
        """Append each sampled token; return one output per sequence that ran."""
        updates = []
        for seq, chunk, token in zip(step.sequences, step.chunks, tokens, strict=True):
            if seq.request.request_id not in self._by_request:
                continue  # aborted while the step ran
            seq.num_computed = chunk.start_pos + len(chunk.token_ids)
            seq.output_ids.append(token)
            reason = self._finish_reason(seq, token)
            first = len(seq.output_ids) == 1
            output = RequestOutput(
                seq.request.request_id, [token], reason,
                len(seq.request.prompt_token_ids) if first else 0,
            )  # fmt: skip
            if reason is not None:
                self.running.remove(seq)
                del self._by_request[seq.request.request_id]
                self._to_free.append(seq.seq_id)
            updates.append(SeqUpdate(seq, output))
        return updates

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        req = seq.request
        if token in req.stop_token_ids or (not req.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= req.max_tokens or len(seq.all_ids) >= self.max_model_len:
            return "length"
        return None

"""Continuous batching with chunked prefill over a paged, prefix-cached KV pool.

One step (:meth:`Scheduler.schedule`) packs, within ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens:

1. every running *decode* (1 token each), oldest admission first;
2. the next chunk of every running, partially prefilled sequence;
3. waiting sequences (new or preempted), first come first served (``--scheduling-policy
   priority``: lower ``priority`` first, and preempted last), each from the end of its
   prefix-cache hit with as much of its prompt as the budget allows (``sample=False`` until
   the chunk that reaches the last token). A sequence whose next full prompt block a running
   one is computing right now (``n > 1`` choices, identical prompts) waits to share it.

With ``--speculative-config`` (and at most ``disable_by_batch_size`` running), a decode also
carries the sequence's drafts (a draft model's proposals are made for every ready decoding
sequence in one batch before the decodes are scheduled; the draft forgets the step's freed
ids); :meth:`Scheduler.update` emits the drafts the samples accept and the next sample, one
token at a time through the stop checks, and rolls the rest back
(:mod:`model_shards.engine.speculative`).

A running sequence short of a block preempts the newest one not in this step (:mod:`.decode`;
under the ``priority`` policy the one ranking last, and a waiting sequence without a seat or
blocks preempts a running one ranking after it);
resumed, that one is recomputed over prompt + output, unchanged because the ranks' sampler is
deterministic per position. No sequence is admitted in a step that preempted.

Several steps may be in flight (pipeline micro-batches): a sequence in an unfinished step is
neither scheduled nor preempted until :meth:`Scheduler.update` records its tokens. Steps run on
every stage in scheduling order, so a block released by an abort can go to a later step at
once. Windowed KV groups release the blocks no later query reads (:mod:`.group_hits`).

Invariant: a block is written only by the one sequence that holds it. Shared blocks are full,
computed and cached: a hit never covers the block of the last token to compute (at most
``(len - 1) // block_size`` blocks hit). The parts of a step: :mod:`model_shards.engine.scheduler`.
"""

from __future__ import annotations

import random
from collections import deque

import msgspec

from model_shards.config.kv_layout import peak_blocks
from model_shards.config.scheduler import SchedulerConfig, SchedulerStats
from model_shards.engine.request_checks import fit_problem
from model_shards.engine.scheduler.admission import admit
from model_shards.engine.scheduler.ahead import done_with, note_ahead, runs_ahead, schedule_ahead
from model_shards.engine.scheduler.block_manager import BlockManager
from model_shards.engine.scheduler.decode import (
    offer_drafts,
    preempt_for_priority,
    schedule_decode,
)
from model_shards.engine.scheduler.prefill import schedule_prefill, step_limits
from model_shards.engine.scheduler.sequence import ScheduledStep, SeqStatus, Sequence, SeqUpdate
from model_shards.engine.scheduler.state import SchedulerState
from model_shards.engine.scheduler.step_builder import StepBuilder
from model_shards.engine.speculative.proposer import BatchProposer
from model_shards.engine.speculative.verify import accepted_run
from model_shards.messages import FinishReason, GenerateRequest, RequestOutput, SeqChunk


class Scheduler:
    """Rank 0's scheduler; see the module docstring for the policy."""

    def __init__(self, config: SchedulerConfig, draft: BatchProposer | None = None) -> None:
        """``draft``: the draft model proposing for ``config.speculative``'s ``model``."""
        if (draft is None) != (config.speculative is None or config.speculative.model is None):
            raise ValueError("a draft model's speculative config and its draft go together")
        self.config = config
        self._draft = draft
        self._state = SchedulerState(config)
        self._next_seq_id = 0
        self._eos = frozenset(config.eos_token_ids)
        self._rng = random.Random()

    @property
    def blocks(self) -> BlockManager:
        """The KV pool's bookkeeping (block ids free, held, cached)."""
        return self._state.blocks

    @property
    def waiting(self) -> deque[Sequence]:
        """Sequences not on the ranks (new, or preempted), first come first served."""
        return self._state.waiting

    @property
    def running(self) -> list[Sequence]:
        """Sequences on the ranks, in admission order (oldest first)."""
        return self._state.running

    @property
    def _by_request(self) -> dict[str, Sequence]:
        return self._state.by_request

    # ---- requests in and out ------------------------------------------------

    def add(self, request: GenerateRequest, client: bytes = b"") -> Sequence:
        """Queue ``request``, giving it a random seed if it has none (ranks never draw one).

        ``ValueError`` if its id is live or it could never run, even alone (:func:`fit_problem`).
        """
        self._check(request)
        sampling = request.sampling
        if sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(63))
        seq = Sequence(
            self._next_seq_id,
            request,
            sampling,
            client,
            output_ids=list(request.resume_output_ids),
        )
        self._next_seq_id += 1
        self._state.enqueue(seq)
        self._by_request[request.request_id] = seq
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Forget a live request (its blocks are released now); ``None`` if unknown."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.RUNNING:
            self._state.retire(seq)
        else:
            self.waiting.remove(seq)
            del self._by_request[request_id]
            seq.status = SeqStatus.FINISHED
        return seq

    def client_of(self, request_id: str) -> bytes | None:
        """The client that submitted a live request, or ``None``."""
        seq = self._by_request.get(request_id)
        return None if seq is None else seq.client

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def hold(self, seq_id: int) -> None:
        """Keep running sequence ``seq_id`` out of steps (and unpreempted) until
        :meth:`release`, as if it were in flight (its grammar mask is being computed)."""
        self._state.in_flight.add(seq_id)

    def release(self, seq_id: int) -> None:
        """Undo :meth:`hold` (a no-op for an id not held)."""
        self._state.in_flight.discard(seq_id)

    def has_pending_frees(self) -> bool:
        """Finished or aborted sequences whose ids the ranks have not been told yet."""
        return bool(self._state.to_free)

    @property
    def stats(self) -> SchedulerStats:
        return self._state.stats()

    # ---- the step -----------------------------------------------------------

    def schedule(self, micro_batches: int = 1) -> ScheduledStep:
        """Decide the next step, possibly empty. With ``micro_batches > 1`` (pipeline overlap)
        it takes at most its share of the live sequences and of the prompt backlog
        (:func:`~model_shards.engine.scheduler.prefill.step_limits`)."""
        state = self._state
        budget, seats = step_limits(state, micro_batches)
        step = StepBuilder(budget, seats, state.take_freed())
        preempt_for_priority(state, step)
        spec = self.config.speculative
        speculate = spec is not None and len(state.running) <= spec.disable_by_batch_size
        if speculate and self._draft is not None:
            offer_drafts(state, self._draft, step)
        self._schedule_running(step, speculate)
        while not step.preempted and admit(state, step):
            pass
        state.in_flight |= step.scheduled
        if self._draft is not None and step.freed:
            self._draft.free(step.freed)
        built = step.build()
        if self.config.async_scheduling:
            note_ahead(state, built)
        return built

    def _schedule_running(self, step: StepBuilder, speculate: bool) -> None:
        """The running sequences' next chunks: every decode first, oldest admitted first, then
        the prompts' chunks; with async scheduling, those in flight follow on (:mod:`.ahead`)."""
        state = self._state
        for decoding in (True, False):
            for seq in list(state.running):
                if step.full:
                    return
                ahead = runs_ahead(state, seq, step)
                if ahead is not None:
                    if (ahead.row >= 0) == decoding:
                        schedule_ahead(state, seq, ahead, step)
                elif not state.ready(seq, step) or seq.is_prefilling == decoding:
                    continue
                elif decoding:
                    schedule_decode(state, seq, step, speculate)
                else:
                    schedule_prefill(state, seq, step)

    def has_schedulable(self) -> bool:
        """Whether a ``schedule()`` now could run anything (waiting, or running not in flight)."""
        in_flight, ahead = self._state.in_flight, self._state.ahead
        return bool(self.waiting) or any(
            s.seq_id not in in_flight or s.seq_id in ahead for s in self.running
        )

    def runs_ahead_of(self, step: ScheduledStep) -> bool:
        """Whether the next step may be scheduled before ``step``'s tokens are applied (async
        scheduling): each of its sequences either follows on (:mod:`.ahead`) or is gone.
        Otherwise one that must wait for its tokens would sit out every other step."""
        state = self._state
        return self.config.async_scheduling and all(
            seq.status is not SeqStatus.RUNNING
            or getattr(state.ahead.get(seq.seq_id), "chunk", None) is chunk
            for seq, chunk in zip(step.sequences, step.chunks, strict=True)
        )

    def update(self, step: ScheduledStep, tokens: list[int]) -> list[SeqUpdate]:
        """Record a step's ``tokens`` (``1 + num_draft`` per ``sample`` chunk, in chunk order) →
        one update per sampled chunk of a still-live sequence. Finished sequences release their
        blocks now; their ids go out with the next step's ``freed_seq_ids``."""
        rows = sum(1 + c.num_draft for c in step.chunks if c.sample)
        if len(tokens) != rows:
            chunks = sum(1 for c in step.chunks if c.sample)
            raise ValueError(
                f"step sampled {chunks} chunks but got {len(tokens)} tokens for {rows} positions"
            )
        state = self._state
        for chunk in step.chunks:
            done_with(state, chunk)
        updates, at = [], 0
        for seq, chunk in zip(step.sequences, step.chunks, strict=True):
            n = 1 + chunk.num_draft if chunk.sample else 0
            samples, at = tokens[at : at + n], at + n
            if (
                seq.status is not SeqStatus.RUNNING
                or state.by_request.get(seq.request_id) is not seq
            ):
                continue
            update = self._apply(seq, chunk, samples)
            if update is not None:
                updates.append(update)
        return updates

    def _apply(self, seq: Sequence, chunk: SeqChunk, samples: list[int]) -> SeqUpdate | None:
        """A live sequence's chunk ran: its KV now reaches the chunk's end (or, after drafts,
        the last accepted one: rejected drafts' positions are computed again later, and the
        blocks holding them are never cached); emit the tokens its ``samples`` accept, one at a
        time up to the first that finishes it."""
        state = self._state
        first_draft = len(chunk.token_ids) - chunk.num_draft
        emitted = accepted_run(chunk.token_ids[first_draft:], samples) if samples else []
        if chunk.num_draft:
            accepted = len(emitted) - 1
            state.counters.spec.record(chunk.num_draft, accepted)
            if seq.proposer is not None:
                seq.proposer.record(accepted)
        out: list[int] = []
        reason: FinishReason | None = None
        for token in emitted:
            seq.append_token(token)
            out.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                break
        seq.num_computed = chunk.start_pos + first_draft + max(0, len(out) - 1)
        state.register_computed_blocks(seq)
        if chunk.num_draft and reason is None:
            state.roll_back(seq)
        if not out:
            return None
        first = len(seq.output_ids) == len(out)
        output = RequestOutput(seq.request_id, out, reason, seq.num_prompt_tokens if first else 0)
        if reason is not None:
            state.retire(seq)
        return SeqUpdate(seq, output)

    def _peak_blocks(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` KV positions holds at most, every KV group's."""
        cfg = self.config
        return peak_blocks(cfg.kv_windows, tokens, cfg.block_size, cfg.max_num_batched_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        req = seq.request
        num_out = len(seq.output_ids)
        if num_out >= seq.sampling.min_tokens and (
            token in req.stop_token_ids or (not req.ignore_eos and token in self._eos)
        ):
            return "stop"
        if num_out >= req.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _check(self, request: GenerateRequest) -> None:
        """``ValueError`` if ``request``'s id is live or it can never run (:func:`fit_problem`)."""
        if request.request_id in self._by_request:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.lora is not None and not self.config.max_loras:
            raise ValueError(
                f"LoRA adapter {request.lora.name!r}: this engine serves none (--enable-lora)"
            )
        cfg = self.config
        problem = fit_problem(
            request, cfg.max_model_len, cfg.block_size, cfg.num_blocks, self._peak_blocks
        )
        if problem:
            raise ValueError(problem)
